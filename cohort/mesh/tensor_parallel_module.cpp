#include "cohort/mesh/tensor_parallel_module.h"

#include "cohort/core/rank_local.h"

namespace cohort {

std::vector<torch::Tensor> TensorParallelModule::tensor_parallel_split_parameters() const {
  std::vector<torch::Tensor> params;
  for (const auto& s : tensor_parallel_splits()) params.push_back(s.parameter);
  return params;
}

void mark_tensor_parallel_split(const TensorParallelModule& module, const Communicator& tp_group) {
  for (const auto& p : module.tensor_parallel_split_parameters()) {
    mark_tensor_parallel_part(p, tp_group.rank(), tp_group.size(), tp_group.name());
  }
}

}  // namespace cohort
