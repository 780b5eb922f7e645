#include "cohort/grad_sync/gradient_presence.h"

#include <torch/types.h>

#include "cohort/comm/communicator.h"

namespace cohort {

std::vector<char> any_rank_has(Communicator& comm, const std::vector<char>& local) {
  auto mask = torch::zeros({static_cast<int64_t>(local.size())}, torch::kInt);
  auto* m = mask.data_ptr<int>();
  for (size_t i = 0; i < local.size(); ++i) m[i] = local[i];
  if (comm.size() > 1) comm.all_reduce(mask, {ReduceOp::Max}).wait();
  return std::vector<char>(m, m + local.size());
}

}  // namespace cohort
