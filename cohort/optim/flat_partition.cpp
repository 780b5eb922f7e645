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
      if (e <= a) continue;  // zero-size parameter
      pieces_.push_back(
          {q, bi, a - params_[q].offset, buckets_[bi].shard_offset + (a - lo), e - a});
    }
  }
}

}  // namespace cohort
