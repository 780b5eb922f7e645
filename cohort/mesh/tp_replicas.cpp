#include "cohort/mesh/tp_replicas.h"

#include <unordered_set>

#include "cohort/core/rank_local.h"
#include "cohort/mesh/tensor_parallel_module.h"

namespace cohort {

std::vector<NamedParameter> tp_replicated_parameters(const torch::nn::Module& module,
                                                     const std::vector<torch::Tensor>& experts) {
  std::unordered_set<const void*> skip;
  for (const auto& p : experts) skip.insert(p.unsafeGetTensorImpl());
  auto visit = [&](const torch::nn::Module& m) {
    const auto* tp = dynamic_cast<const TensorParallelModule*>(&m);
    if (!tp) return;
    for (const auto& p : tp->tensor_parallel_split_parameters()) {
      if (p.defined()) skip.insert(p.unsafeGetTensorImpl());
    }
  };
  visit(module);
  for (const auto& m : module.modules(/*include_self=*/false)) visit(*m);
  std::vector<NamedParameter> out;
  for (const auto& item : module.named_parameters()) {
    const auto& p = item.value();
    if (skip.count(p.unsafeGetTensorImpl())) continue;
    if (!rank_local_refusal({p}).empty()) continue;
    out.emplace_back(item.key(), p);
  }
  return out;
}

torch::Tensor tp_digests(Communicator& tp, const std::vector<torch::Tensor>& tensors,
                         torch::Device device) {
  std::vector<torch::Tensor> parts;
  for (const auto& t : tensors) {
    if (!t.defined()) {
      parts.push_back(torch::zeros({2}, torch::dtype(torch::kFloat64).device(device)));
      continue;
    }
    auto d = t.detach().to(device, torch::kFloat64);
    parts.push_back(torch::stack({d.sum(), d.abs().sum()}));
  }
  auto mine = torch::stack(parts).reshape({-1});
  auto all = torch::empty({tp.size() * mine.numel()}, mine.options());
  tp.all_gather_into_tensor(all, mine).wait();
  return all.reshape({tp.size(), -1, 2}).cpu();
}

std::string tp_replica_values_mismatch(Communicator& tp,
                                       const std::vector<NamedParameter>& replicas,
                                       const std::string& sum_of) {
  if (replicas.empty()) return "";
  std::vector<torch::Tensor> values;
  for (const auto& named : replicas) values.push_back(named.second);
  const auto table = tp_digests(tp, values, values.front().device());
  auto t = table.accessor<double, 3>();
  for (size_t i = 0; i < replicas.size(); ++i) {
    for (int r = 1; r < tp.size(); ++r) {
      if (t[r][i][0] == t[0][i][0] && t[r][i][1] == t[0][i][1]) continue;
      return "the values of parameter '" + replicas[i].first +
             "', whole on every TP rank, differ across TP ranks (sum" + sum_of + " " +
             std::to_string(t[0][i][0]) + " on tp rank 0, " + std::to_string(t[r][i][0]) +
             " on tp rank " + std::to_string(r) +
             "): its TP replicas would train apart. Draw them from the same seed on every TP "
             "rank; if a layer of your own splits it over TP, implement TensorParallelModule in "
             "that layer";
    }
  }
  return "";
}

}  // namespace cohort
