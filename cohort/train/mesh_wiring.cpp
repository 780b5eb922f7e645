#include "cohort/train/mesh_wiring.h"

#include <cmath>

#include "cohort/comm/communicator.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/train/trainer_wiring.h"

namespace cohort {
namespace {

using tensor_parallel::ColumnParallelLinearImpl;
using tensor_parallel::RowParallelLinearImpl;
using tensor_parallel::VocabParallelEmbeddingImpl;

// The parameters the TP layers split (a row-parallel bias is whole).
std::set<const void*> tp_sharded(torch::nn::Module& stages) {
  std::set<const void*> out;
  auto add = [&](const torch::Tensor& t) {
    if (t.defined()) out.insert(t.unsafeGetTensorImpl());
  };
  for (const auto& m : stages.modules()) {
    if (auto* c = dynamic_cast<ColumnParallelLinearImpl*>(m.get())) {
      add(c->weight);
      add(c->bias);
    } else if (auto* r = dynamic_cast<RowParallelLinearImpl*>(m.get())) {
      add(r->weight);
    } else if (auto* v = dynamic_cast<VocabParallelEmbeddingImpl*>(m.get())) {
      add(v->weight);
    }
  }
  return out;
}

}  // namespace

MeshGradNorm::MeshGradNorm(std::shared_ptr<DeviceMesh> mesh, torch::nn::Module& stages,
                           const torch::Tensor& tied_copy)
    : mesh_(std::move(mesh)), sharded_(tp_sharded(stages)) {
  if (tied_copy.defined()) tied_copy_ = tied_copy.unsafeGetTensorImpl();
}

bool MeshGradNorm::counts(const torch::Tensor& p) const {
  if (p.unsafeGetTensorImpl() == tied_copy_) return false;
  return mesh_->tp_rank() == 0 || sharded_.count(p.unsafeGetTensorImpl()) > 0;
}

double MeshGradNorm::global_norm(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> counted;
  for (const auto& p : params) {
    if (counts(p)) counted.push_back(p);
  }
  auto sq = torch::tensor({local_squared_norm(counted)}, torch::kFloat64);
  mesh_->tp_group()->all_reduce(sq, {ReduceOp::Sum}).wait();
  mesh_->pp_group()->all_reduce(sq, {ReduceOp::Sum}).wait();
  return std::sqrt(sq.item<double>());
}

}  // namespace cohort
