#include "cohort/data/seed.h"

#include <torch/types.h>
#include <torch/utils.h>

#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"

namespace cohort::data {

uint64_t rank_seed(uint64_t seed, int rank) {
  // SplitMix64's finalizer over seed and rank: a bijection of its input,
  // so distinct ranks of one base seed never share a seed.
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (static_cast<uint64_t>(rank) + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t manual_seed(uint64_t seed, SeedScope scope, Communicator& comm) {
  // Every rank's (seed, scope), compared on every rank.
  const auto mine =
      torch::tensor({static_cast<int64_t>(seed), static_cast<int64_t>(scope == SeedScope::PerRank)},
                    torch::kLong);
  std::vector<torch::Tensor> all;
  for (int r = 0; r < comm.size(); ++r) all.push_back(torch::empty({2}, torch::kLong));
  comm.all_gather(all, mine).wait();
  std::string differ;
  for (int r = 0; r < comm.size(); ++r) {
    if (torch::equal(all[r], all[0])) continue;
    differ += " rank " + std::to_string(r) + " (seed " +
              std::to_string(static_cast<uint64_t>(all[r][0].item<int64_t>())) +
              (all[r][1].item<int64_t>() ? ", PerRank)" : ", Same)");
  }
  if (!differ.empty()) {
    throw InvalidArgument("data::manual_seed on rank " + std::to_string(comm.rank()) +
                          ": the ranks differ: rank 0 (seed " +
                          std::to_string(static_cast<uint64_t>(all[0][0].item<int64_t>())) +
                          (all[0][1].item<int64_t>() ? ", PerRank)" : ", Same)") + " against" +
                          differ);
  }
  const uint64_t used = scope == SeedScope::Same ? seed : rank_seed(seed, comm.rank());
  torch::manual_seed(used);
  return used;
}

}  // namespace cohort::data
