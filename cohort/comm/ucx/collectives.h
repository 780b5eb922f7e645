// defines: the UCX engine's collectives, written over Link (point-to-point)
// like cohort's algorithm library, which they call for the all-reduce and
// the all-gather.
//
// Cost models, p ranks, n bytes (alpha per message, beta per byte):
//   broadcast, reduce (binomial tree):  ceil(log2 p) (alpha + n beta)
//   gather, scatter (direct to/from the root): (p-1) alpha + (p-1)/p n beta at the root
//   all_to_all (every pair at once):   (p-1) alpha + (p-1)/p n beta
//   barrier (dissemination):            ceil(log2 p) alpha
// All-reduce: recursive doubling up to kRecursiveDoublingBytes on
// power-of-two groups, kDirectExchangeBytes at world 2 (the engine calls
// small_all_reduce), halving-doubling
// up to kHalvingDoublingBytes (latency log p), the ring above
// (bandwidth-optimal); all-gather: the ring.
#pragma once

#include <vector>

#include "cohort/algorithms/link.h"
#include "cohort/comm/ucx/worker.h"

namespace cohort::ucx {

using algorithms::Link;

// At or below this many bytes an all-reduce takes halving-doubling.
inline constexpr int64_t kHalvingDoublingBytes = 256 << 10;

void all_reduce(Link& link, at::Tensor& buf, ReduceOp op);

// At or below this many bytes, on a power-of-two group, an all-reduce takes
// recursive doubling on raw buffers (small_all_reduce).
inline constexpr int64_t kRecursiveDoublingBytes = 64 << 10;
// At world 2 recursive doubling is a direct exchange (one message each way,
// then a local reduction), and it stays the choice up to this many bytes:
// at 1 MiB it took 117 us against the ring's 125 us on the caller's thread,
// 140 against 189 on the engine's (float32 sum, medians of 5 alternated
// runs; plain MPI_Allreduce 128 us). The message is one rendezvous (a CMA
// single-copy read) instead of the ring's two of half the size, plus no
// tensor views. Above it the ring, which met MPI at 16 MiB. At most 2 Mi
// elements of one byte: the fused check tag carries the count
// (collective_check.h).
inline constexpr int64_t kDirectExchangeBytes = 1 << 20;
// Recursive doubling: log2(p) rounds, each exchanging the whole vector with
// rank ^ 2^k and reducing in place: half the rounds of halving-doubling, and
// no tensor views (a LibTorch view costs about a microsecond, which is most
// of a 1 KiB all-reduce). Every rank combines the same operands in an order
// that differs only by commutation, so all get bitwise the same result.
// `tmp` is like `buf`; `tmp_full` is its memory, at least a check message
// long. With a `fused` tag (world 2, collective_check.h) the one exchange is
// also the collective's check: the message carries the descriptor in its
// tag and is received in the check slot.
bool small_all_reduce_handles(at::ScalarType dtype);
void small_all_reduce(Worker& worker, at::Tensor& buf, at::Tensor& tmp, at::Tensor& tmp_full,
                      ReduceOp op, Clock::time_point deadline, uint32_t fused);
void broadcast(Link& link, at::Tensor& t, int root);
// The root's `t` receives the reduction; other ranks' `t` is left as it was.
void reduce(Link& link, at::Tensor& t, int root, ReduceOp op);
void all_gather(Link& link, std::vector<at::Tensor>& outputs, const at::Tensor& input);
void gather(Link& link, std::vector<at::Tensor>& outputs, const at::Tensor& input, int root);
void scatter(Link& link, at::Tensor& output, std::vector<at::Tensor>& inputs, int root);
// Counts are elements per rank; empty means an equal split.
void all_to_all(Link& link, at::Tensor& output, const at::Tensor& input,
                std::vector<int64_t> output_counts, std::vector<int64_t> input_counts);
void barrier(Link& link);

}  // namespace cohort::ucx
