// defines: SeedScope, rank_seed and manual_seed: LibTorch's random state
// seeded alike on every rank or per rank.
//
//   cohort::data::manual_seed(42, cohort::data::SeedScope::Same, *comm);
//   Model model;                   // the same initial weights on every rank
//   cohort::data::manual_seed(42, cohort::data::SeedScope::PerRank, *comm);
//   ... dropout masks and noise now differ from rank to rank
//
// Which scope a draw needs is the program's to say: anything every rank
// must agree on (data each rank makes itself, weights no wrapper aligns)
// wants Same; dropout, noise and data augmentation want PerRank (with Same,
// every rank draws the same masks on different data). DDP and fully_shard
// broadcast rank 0's initial parameters, so under them initialization
// agrees whatever the seeds.
#pragma once

#include <cstdint>

namespace cohort {
class Communicator;
}

namespace cohort::data {

/// Whether the ranks' random states agree or differ.
enum class SeedScope {
  Same,    ///< every rank gets `seed` itself
  PerRank  ///< rank r gets rank_seed(seed, r): distinct across ranks
};

/// The seed rank `rank` gets under SeedScope::PerRank: a SplitMix64 mix
/// of `seed` and the rank (distinct for distinct ranks, and unlike
/// `seed + rank`, not shared with the next base seed's rank 0).
uint64_t rank_seed(uint64_t seed, int rank);

/// Seeds LibTorch's default generators (torch::manual_seed) on this rank
/// with `seed` or rank_seed(seed, rank) by `scope`, and returns the seed
/// used. Collective over `comm`: every rank must pass the same seed and
/// scope, else InvalidArgument on every rank naming the ranks that differ
/// (a mismatch would silently break the agreement Same exists for).
uint64_t manual_seed(uint64_t seed, SeedScope scope, Communicator& comm);

}  // namespace cohort::data
