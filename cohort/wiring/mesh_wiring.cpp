#include "cohort/wiring/mesh_wiring.h"

#include <algorithm>
#include <cmath>

#include "cohort/comm/communicator.h"
#include "cohort/expert_parallel/moe.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/wiring/trainer_wiring.h"

namespace cohort {

MeshGradNorm::MeshGradNorm(DeviceMesh mesh, torch::nn::Module& stages,
                           const std::vector<torch::Tensor>& tied_copies)
    : mesh_(std::move(mesh)), sharded_(tensor_parallel::split_dims(stages)) {
  for (const auto& t : tied_copies) tied_copies_.insert(t.unsafeGetTensorImpl());
  // Experts split over tp hold different slices on each tp rank: each counts.
  for (const auto& e : expert_parallel::expert_tensor_split_dims(stages)) sharded_.insert(e);
  const auto names = mesh_.dim_names();
  if (std::find(names.begin(), names.end(), "ep") != names.end() && mesh_.size("ep") > 1) {
    for (const auto& p : expert_parallel::expert_parameters(stages)) {
      experts_.insert(p.unsafeGetTensorImpl());
    }
  }
}

bool MeshGradNorm::counts(const torch::Tensor& p) const {
  if (tied_copies_.count(p.unsafeGetTensorImpl())) return false;
  return mesh_.local_rank("tp") == 0 || sharded_.count(p.unsafeGetTensorImpl()) > 0;
}

double MeshGradNorm::global_norm(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> counted, experts;
  for (const auto& p : params) {
    if (counts(p)) (experts_.count(p.unsafeGetTensorImpl()) ? experts : counted).push_back(p);
  }
  auto sq = torch::tensor({local_squared_norm(counted)}, torch::kFloat64);
  if (!experts_.empty()) {
    auto e = torch::tensor({local_squared_norm(experts)}, torch::kFloat64);
    mesh_["ep"].process_group()->all_reduce(e, {ReduceOp::Sum}).wait();
    sq += e;
  }
  mesh_["tp"].process_group()->all_reduce(sq, {ReduceOp::Sum}).wait();
  mesh_["pp"].process_group()->all_reduce(sq, {ReduceOp::Sum}).wait();
  return std::sqrt(sq.item<double>());
}

TensorParallelGradNorm::TensorParallelGradNorm(torch::nn::Module& model,
                                               std::shared_ptr<Communicator> tp_group,
                                               std::shared_ptr<Communicator> shard_group)
    : split_(tensor_parallel::split_dims(model)),
      tp_group_(std::move(tp_group)),
      shard_group_(std::move(shard_group)) {}

double TensorParallelGradNorm::global_norm(const std::vector<torch::Tensor>& params) {
  const bool first = tp_group_->rank() == 0;
  std::vector<torch::Tensor> counted;
  for (const auto& p : params) {
    if (first || split_.count(p.unsafeGetTensorImpl())) counted.push_back(p);
  }
  auto sq = torch::tensor({local_squared_norm(counted)}, torch::kFloat64);
  if (shard_group_) shard_group_->all_reduce(sq, {ReduceOp::Sum}).wait();
  tp_group_->all_reduce(sq, {ReduceOp::Sum}).wait();
  return std::sqrt(sq.item<double>());
}

}  // namespace cohort
