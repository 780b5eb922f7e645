#include "cohort/optim/flat_partition.h"

#include <algorithm>

#include "cohort/core/error.h"

namespace cohort {

FlatPartition::FlatPartition(const std::vector<int64_t>& numels, const std::vector<size_t>& groups,
                             int world, int rank, int64_t bucket_elements)
    : world_(world), rank_(rank) {
  if (world < 1 || rank < 0 || rank >= world || numels.size() != groups.size()) {
    throw InvalidArgument("FlatPartition: rank " + std::to_string(rank) + " of world " +
                          std::to_string(world) + " with " + std::to_string(numels.size()) +
                          " sizes and " + std::to_string(groups.size()) + " groups");
  }
  for (size_t i = 0; i < numels.size(); ++i) {
    params_.push_back({numel_, numels[i], groups[i]});
    numel_ += numels[i];
  }
  const int64_t cap = std::max<int64_t>(1, (bucket_elements + world - 1) / world) * world;
  int64_t shard = 0;
  for (int64_t off = 0; off < numel_; off += cap) {
    Bucket b;
    b.offset = off;
    b.numel = std::min(cap, numel_ - off);
    b.padded = (b.numel + world - 1) / world * world;
    b.chunk = b.padded / world;
    b.shard_offset = shard;
    shard += b.chunk;
    buckets_.push_back(b);
  }
  padded_numel_ = shard * world;

  // Walk this rank's chunks and the parameters together (both sorted).
  size_t p = 0;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const int64_t lo = chunk_offset(bi), hi = lo + buckets_[bi].chunk;
    while (p < params_.size() && params_[p].offset + params_[p].numel <= lo) ++p;
    for (size_t q = p; q < params_.size() && params_[q].offset < hi; ++q) {
      const int64_t a = std::max(lo, params_[q].offset);
      const int64_t e = std::min(hi, params_[q].offset + params_[q].numel);
      if (e <= a) continue;  // zero-size parameter: below
      pieces_.push_back(
          {q, bi, a - params_[q].offset, buckets_[bi].shard_offset + (a - lo), e - a});
    }
  }
  if (rank_ != 0 || buckets_.empty()) return;
  // Rank 0 holds each parameter of no elements, in the bucket where its
  // offset lies, at the place in its chunk nearest to that offset.
  bool added = false;
  for (size_t q = 0; q < params_.size(); ++q) {
    if (params_[q].numel != 0) continue;
    size_t bi = 0;
    while (bi + 1 < buckets_.size() && params_[q].offset >= buckets_[bi + 1].offset) ++bi;
    const auto& b = buckets_[bi];
    const int64_t at = std::clamp<int64_t>(params_[q].offset - b.offset, 0, b.chunk);
    pieces_.push_back({q, bi, 0, b.shard_offset + at, 0});
    added = true;
  }
  if (!added) return;
  std::stable_sort(pieces_.begin(), pieces_.end(), [](const Piece& x, const Piece& y) {
    if (x.bucket != y.bucket) return x.bucket < y.bucket;
    if (x.shard_offset != y.shard_offset) return x.shard_offset < y.shard_offset;
    return x.param < y.param;
  });
}

}  // namespace cohort
