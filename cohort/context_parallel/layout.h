// defines: ZigZagLayout, the load-balanced split of a causal sequence over
// the context-parallel ranks, and the helpers that shard a full sequence into
// it and gather it back.
//
// The sequence of S positions is cut into n = 2·cp chunks, and rank r holds
// chunks r and n-1-r, one early and one late: under a causal mask the early
// chunk sees few keys and the late one many, so every rank has the same
// attention work. When S does not divide by n, the first S mod n chunks are
// one position longer. A rank's local rows are its two chunks back to back,
// in ascending global position.
#pragma once

#include <torch/types.h>

#include <array>
#include <memory>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort::context_parallel {

/// The zig-zag split of `length` positions over `cp` ranks (2·cp chunks).
class ZigZagLayout {
 public:
  /// Throws InvalidArgument unless cp >= 1 and length >= 2·cp (every chunk
  /// holds at least one position).
  ZigZagLayout(int64_t length, int cp);

  /// The sequence length S.
  int64_t length() const { return length_; }
  /// The number of ranks.
  int cp() const { return cp_; }
  /// The number of chunks, 2·cp.
  int chunks() const { return 2 * cp_; }
  /// First global position of chunk c.
  int64_t chunk_start(int c) const;
  /// Positions in chunk c: S / 2cp, plus one for the first S mod 2cp chunks.
  int64_t chunk_length(int c) const;
  /// The chunks rank r holds, early one first: {r, 2·cp-1-r}.
  std::array<int, 2> chunks_of(int rank) const { return {rank, 2 * cp_ - 1 - rank}; }
  /// Rows rank r holds: the lengths of its two chunks together.
  int64_t local_length(int rank) const;
  /// Global positions of rank r's local rows, ascending (int64).
  torch::Tensor positions(int rank) const;

 private:
  int64_t length_;
  int cp_;
};

/// Rank `rank`'s rows of `full` along `dim` (its two chunks), contiguous.
torch::Tensor shard_sequence(const torch::Tensor& full, int rank, int cp, int64_t dim = 2);

/// The full sequence from every rank's shard (shards[r] is rank r's), along `dim`.
torch::Tensor unshard_sequence(const std::vector<torch::Tensor>& shards, int64_t dim = 2);

/// Collective over `group`: every rank gets the full sequence from the
/// local shards (one all-gather of shards padded to the longest). Not
/// differentiable: for evaluation and logging; use it under NoGradGuard or
/// on detached tensors. A shard that requires grad under grad mode on any
/// rank: InvalidArgument on every rank, naming that rank.
torch::Tensor gather_sequence(const torch::Tensor& local, Communicator& group, int64_t dim = 2);

}  // namespace cohort::context_parallel
