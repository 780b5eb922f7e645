#include "cohort/grad_sync/gradient_presence.h"

#include <torch/types.h>

#include "cohort/comm/communicator.h"
#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort {

std::vector<char> any_rank_has(Communicator& comm, const std::vector<char>& local) {
  auto mask = torch::zeros({static_cast<int64_t>(local.size())}, torch::kInt);
  auto* m = mask.data_ptr<int>();
  for (size_t i = 0; i < local.size(); ++i) m[i] = local[i];
  if (comm.size() > 1) comm.all_reduce(mask, {ReduceOp::Max}).wait();
  return std::vector<char>(m, m + local.size());
}

std::vector<char> any_rank_has_unless_refused(Communicator& comm, const std::vector<char>& local,
                                              const std::string& refusal,
                                              const std::string& where) {
  const size_t n = local.size(), world = static_cast<size_t>(comm.size());
  std::vector<char> words(local);
  words.resize(n + world, 0);
  words[n + static_cast<size_t>(comm.rank())] = refusal.empty() ? 0 : 1;
  auto all = any_rank_has(comm, words);
  if (!refusal.empty()) throw InvalidArgument(where + ": " + refusal);
  const std::vector<char> refused(all.begin() + static_cast<std::ptrdiff_t>(n), all.end());
  const std::string ranks = flagged_ranks(refused);
  if (!ranks.empty()) {
    const bool one = ranks.rfind("rank ", 0) == 0;
    throw InvalidArgument(where + ": " + ranks + " cannot take this step (" +
                          (one ? "its" : "their") + " own error says why), so no rank takes it");
  }
  all.resize(n);
  return all;
}

}  // namespace cohort
