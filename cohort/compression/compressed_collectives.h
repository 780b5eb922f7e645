// defines: the compressed collectives every compressor is built on:
// low_precision_all_reduce (float16/bfloat16 on the wire, float32 sums),
// int8_all_reduce (two phases with per-chunk scales and error feedback).
//
// Both run over the communicator's tagged point-to-point (cohort's ring
// algorithms on a Link), so the bytes that leave a rank are the compressed
// ones on every engine: an engine's own all_reduce would upcast 16-bit data
// (Gloo reduces it in float32) and has no int8 sum at all.
//
// Cost, p ranks, n elements (bytes sent per rank):
//   uncompressed ring all-reduce (float32): 2 (p-1)/p * 4n
//   low_precision_all_reduce:               2 (p-1)/p * 2n
//   int8_all_reduce, chunk c:               2 (p-1)/p * (n + 4n/c)
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace cohort {

class Communicator;

namespace compression {

/// Tags at and above this value on the communicator's point-to-point are
/// used by the compressed collectives; user send/recv should stay below it.
inline constexpr int kCompressionTagBase = 1 << 28;

/// Averages the flat float32 `buf` over the ranks of `comm` in place,
/// sending it as `wire` (at::kHalf or at::kBFloat16): a ring reduce-scatter
/// whose hops carry 16-bit partial sums that each rank adds in float32, then
/// a ring all-gather of the 16-bit result. The values are scaled by 1/p
/// before the first cast (as PyTorch's fp16 hook: no overflow from the sum)
/// and every rank ends with the same values. Collective; blocking.
void low_precision_all_reduce(Communicator& comm, at::Tensor& buf, at::ScalarType wire);

/// Error-feedback buffers of int8_all_reduce for one tensor: what this rank's
/// quantization dropped (worker side, the whole tensor) and what the owner's
/// requantization of its chunk of the average dropped (owner side).
struct Int8ErrorFeedback {
  /// Worker side: this rank's quantization error over the whole tensor (float32, the tensor's
  /// size).
  at::Tensor worker;
  /// Owner side: the requantization error of the chunk of the average this rank owns.
  at::Tensor owner;
};

/// Averages the flat float32 `buf` over `comm` in place in two phases:
/// 1. every rank quantizes buf (+ its worker error) to int8 with one float32
///    scale per `chunk` elements (fewer when buf has under `chunk` elements
///    per rank) and sends each owner its chunks; each owner dequantizes and
///    sums them in float32;
/// 2. each owner requantizes its averaged chunks (+ its owner error) and
///    sends the int8 chunks and scales to every rank.
/// The tensor is cut into segments of `segment_chunks` chunks, each split
/// among all ranks as owners, and the segments are pipelined: one segment is
/// quantized while the previous one is averaged and the one before it is
/// gathered, so the arithmetic and both phases overlap on the wire.
/// With `feedback` null no error is kept (a plain quantized all-reduce); else
/// its buffers are (re)sized (worker: buf's size; owner: the elements this
/// rank owns over all segments) and updated. A chunk holding inf or NaN is
/// sent as each value's class (+inf, -inf, NaN, or finite, which arrives as
/// 0 and stays in the error buffer), so the result holds inf or NaN where
/// the float32 sum would and the error buffers stay finite. Every rank must
/// pass the same size and chunk (the compressors check; this does not).
/// Collective; blocking.
void int8_all_reduce(Communicator& comm, at::Tensor& buf, int64_t chunk,
                     Int8ErrorFeedback* feedback, int64_t segment_chunks = 64);

/// The elements of an n-element tensor that `rank` of `size` owns in
/// int8_all_reduce with these settings, as (offset, count) in the order of
/// its owner error buffer.
std::vector<std::pair<int64_t, int64_t>> int8_owned_elements(int64_t n, int64_t chunk, int rank,
                                                             int size, int64_t segment_chunks = 64);

}  // namespace compression
}  // namespace cohort
