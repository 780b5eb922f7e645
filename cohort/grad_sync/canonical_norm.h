// defines: canonical_squared_norm, the sum of squares of a flat gradient in
// one order fixed by the global flat index alone, so that clipping by the
// global norm gives the same bits whether the gradient is whole on every
// rank (DDP) or cut into per-rank chunks (ZeRO-2, FSDP) of any world size.
// Design: cohort/grad_sync/README.md.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace cohort {

class Communicator;

/// Elements per block of canonical_squared_norm (below ATen's grain size, so
/// one block's sum never splits over intra-op threads).
constexpr int64_t kCanonicalNormBlock = 4096;

/// The sum of squares of a global flat vector of `total` elements, of which
/// this rank holds `slice` = elements [offset, offset + slice.numel()) (the
/// ranks' slices tile [0, total) in rank order; a slice may be empty).
/// Order: the vector is cut into blocks of kCanonicalNormBlock elements at
/// multiples of the block size; each block's squares are summed in float64
/// by one torch::sum over a fresh contiguous tensor; the block sums are added
/// in block order, one by one. A block straddling ranks is completed by the
/// rank where it starts, from the others' leading fragments (one
/// all-gather). Collective over `comm` when it is non-null (every rank
/// calls it); with null, `slice` must be the whole vector. Every rank returns
/// the same bits, at every world size.
double canonical_squared_norm(Communicator* comm, const torch::Tensor& slice, int64_t offset,
                              int64_t total);

}  // namespace cohort
