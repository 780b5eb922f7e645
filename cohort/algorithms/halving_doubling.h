// defines: recursive halving-doubling (Rabenseifner; MPICH's and Gloo's
// allreduce_halving_doubling) for all-reduce, reduce-scatter and all-gather.
//
// Cost model, p ranks (p2 = largest power of two <= p), n bytes:
//   all-reduce:  2 log2(p2) alpha + 2 (p2-1)/p2 n beta   (+ 2 (alpha + n beta)
//                                                          when p is not a power of two)
// Latency logarithmic in p, bandwidth-optimal for powers of two: the
// medium-size choice. Non-powers of two: the first 2(p-p2) ranks pair up,
// the even one hands its vector to the odd one and sits out the halving and
// doubling (MPICH's scheme), then gets the result (all-reduce) or its block
// (reduce-scatter) back.
#pragma once

#include <vector>

#include "cohort/algorithms/link.h"

namespace cohort::algorithms {

void hd_all_reduce(Link& link, at::Tensor& buf, ReduceOp op);

// `work` holds this rank's p blocks (scratch, overwritten); on return
// blocks[rank] of `work` is reduced over all ranks.
void hd_reduce_scatter(Link& link, at::Tensor& work, const std::vector<Span>& blocks, ReduceOp op);

// On entry blocks[rank] of `buf` holds this rank's part; on return all do.
void hd_all_gather(Link& link, at::Tensor& buf, const std::vector<Span>& blocks);

}  // namespace cohort::algorithms
