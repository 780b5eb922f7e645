// defines: the ring algorithms: reduce-scatter, all-gather, and all-reduce as
// one followed by the other (Patarasuk & Yuan; Gloo's allreduce_ring_chunked).
//
// Cost model, p ranks, n bytes, per-message latency alpha, per-byte time beta:
//   reduce-scatter, all-gather:  (p-1) alpha + (p-1)/p n beta
//   all-reduce:                 2(p-1) alpha + 2(p-1)/p n beta
// Bandwidth-optimal, latency linear in p: the large-message choice.
//
// Blocks are cut into segments (kSegmentBytes): a segment received at step s
// is reduced and forwarded at step s+1 while later segments are still on the
// wire. Receives are posted before the matching sends.
#pragma once

#include <vector>

#include "cohort/algorithms/link.h"

namespace cohort::algorithms {

// On return, blocks[rank] of `work` holds the reduction of blocks[rank] of
// every rank's `src`; other blocks of `work` are scratch. `src` is only read
// and may be `work` itself (in place). A `wire` dtype other than work's makes
// the partial results travel cast to it and be reduced in work's dtype
// (compression's float16/bfloat16 all-reduce).
void ring_reduce_scatter(Link& link, const at::Tensor& src, at::Tensor& work,
                         const std::vector<Span>& blocks, ReduceOp op,
                         at::ScalarType wire = at::ScalarType::Undefined);

// On entry blocks[rank] of `buf` holds this rank's part; on return every
// block holds its rank's part.
void ring_all_gather(Link& link, at::Tensor& buf, const std::vector<Span>& blocks);

// `buf` (flat) reduced over all ranks, in place.
void ring_all_reduce(Link& link, at::Tensor& buf, ReduceOp op);

}  // namespace cohort::algorithms
