#include "cohort/compression/compressed_collectives.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cohort/algorithms/link.h"
#include "cohort/algorithms/ring.h"
#include "cohort/comm/communicator.h"
#include "cohort/comm/communicator_point_to_point.h"
#include "cohort/core/error.h"

namespace cohort::compression {
namespace {

using algorithms::Link;
using algorithms::Span;

// A Link over the communicator's own send/recv, tags moved above
// kCompressionTagBase, so that cohort's ring algorithms run on it.
Link make_link(CommunicatorPointToPoint& transport, Communicator& comm, const std::string& what) {
  return Link(transport,
              what + " on rank " + std::to_string(comm.rank()) + " of " +
                  std::to_string(comm.size()) + " (group " + comm.name() + ")",
              algorithms::Clock::now() + comm.timeout());
}

void check_flat_float(const at::Tensor& buf, const std::string& op) {
  if (!buf.defined() || buf.scalar_type() != at::kFloat || buf.dim() != 1 || !buf.is_contiguous() ||
      !buf.device().is_cpu()) {
    throw InvalidArgument("cohort: " + op + " takes a flat, contiguous float32 CPU tensor");
  }
}

at::Tensor part(const at::Tensor& t, const Span& s) { return t.narrow(0, s.offset, s.count); }

// The int8 arithmetic as fused loops over raw float32 data: one pass per
// chunk for its scale, one that rounds, clamps, stores the code and the
// error together, instead of a padded copy, a cast and a temporary per ATen
// op (what int8 spent beyond the wire). A chunk of 2048 floats stays in L1
// between its two passes. The arithmetic is the ATen form's: scale =
// amax/127, code = round-half-even(v * (1/scale)) clamped to +-127.

// Round to nearest, ties to even, for |v| < 2^22, without a libm call (so
// the loop vectorises with SSE2): adding 1.5 * 2^23 leaves no fraction bits.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

// Largest |v| over [begin, end) with v = x (+ error). A float max
// reduction does not vectorise without -ffast-math, but for |v| the IEEE
// bit patterns order as unsigned integers, whose max does; kError picks the
// loop at compile time (GCC does not vectorise one with that branch).
template <bool kError>
float chunk_amax(const float* x, const float* error, int64_t begin, int64_t end) {
  uint32_t m = 0;
  for (int64_t i = begin; i < end; ++i) {
    const float v = kError ? x[i] + error[i] : x[i];
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    bits &= 0x7fffffffu;
    m = bits > m ? bits : m;
  }
  float amax;
  std::memcpy(&amax, &m, sizeof amax);
  return amax;
}

// A chunk holding inf or NaN cannot be scaled: it is sent with the scale
// kNonFinite and codes that name each value's class (kPosInf, kNegInf,
// kNaN; 0 for a finite value, which arrives as 0 this step). So +inf stays
// +inf however the ranks' values add up, where an infinite scale times
// a clamped code would flip signs or spread NaN over the chunk. The error
// buffer keeps each finite value (it was not delivered) and drops the
// non-finite ones, so one bad step does not poison the steps after it.
constexpr float kFloatMax = std::numeric_limits<float>::max();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNonFinite = kInf;  // the scale that marks such a chunk
constexpr int8_t kPosInf = 127, kNegInf = -127, kNaN = -128;

inline bool finite(float v) { return std::abs(v) <= kFloatMax; }

inline float non_finite_value(int8_t code) {
  if (code == kPosInf) return kInf;
  if (code == kNegInf) return -kInf;
  if (code == kNaN) return std::numeric_limits<float>::quiet_NaN();
  return 0.0f;
}

template <bool kError>
void quantize_non_finite(const float* x, float* error, int64_t begin, int64_t end, int8_t* codes) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = kError ? x[i] + error[i] : x[i];
    codes[i] = std::isnan(v) ? kNaN : v == kInf ? kPosInf : v == -kInf ? kNegInf : 0;
    if (kError) error[i] = finite(v) ? v : 0.0f;
  }
}

template <bool kError>
void quantize_chunks(const float* x, float* error, int64_t n, int64_t chunk, int8_t* codes,
                     float* scales) {
  for (int64_t c = 0, begin = 0; begin < n; ++c, begin += chunk) {
    const int64_t end = std::min(n, begin + chunk);
    const float amax = chunk_amax<kError>(x, error, begin, end);
    if (!finite(amax)) {
      quantize_non_finite<kError>(x, error, begin, end, codes);
      scales[c] = kNonFinite;
      continue;
    }
    // 127 * scale must stay finite (amax near the float maximum), or the
    // error v - 127 * scale would be -inf.
    float scale = amax / 127.0f;
    while (!finite(scale * 127.0f)) scale = std::nextafter(scale, 0.0f);
    float inverse = 1.0f / scale;
    // A chunk whose largest |v| is below about 3.7e-37 (scale 0 included)
    // has no finite inverse, and 0 * inf would be a NaN clamped to -127:
    // zeros would arrive as -amax. It is sent as zeros (error feedback
    // keeps the values).
    if (!finite(inverse)) {
      inverse = 0.0f;
      scale = 0.0f;
    }
    scales[c] = scale;
    for (int64_t i = begin; i < end; ++i) {
      const float v = kError ? x[i] + error[i] : x[i];
      const float q = std::min(127.0f, std::max(-127.0f, round_even(v * inverse)));
      codes[i] = static_cast<int8_t>(q);
      if (kError) error[i] = v - q * scale;
    }
  }
}

// Quantizes v = x (+ error) to `codes` with one scale per `chunk` elements;
// with `error` non-null it becomes v - dequantized (what was dropped).
void quantize(const float* x, float* error, int64_t n, int64_t chunk, int8_t* codes,
              float* scales) {
  if (error) {
    quantize_chunks<true>(x, error, n, chunk, codes, scales);
  } else {
    quantize_chunks<false>(x, nullptr, n, chunk, codes, scales);
  }
}

// out = factor * (sum over the sources of codes * their chunk's scale), in
// one pass over out (sources added in the order given, the same on every
// rank).
void dequantize_sum(const std::vector<const int8_t*>& codes,
                    const std::vector<const float*>& scales, int64_t n, int64_t chunk, float factor,
                    float* out) {
  for (int64_t c = 0, begin = 0; begin < n; ++c, begin += chunk) {
    const int64_t end = std::min(n, begin + chunk);
    for (size_t s = 0; s < codes.size(); ++s) {
      const float scale = scales[s][c];
      const int8_t* code = codes[s];
      if (!finite(scale)) {  // a chunk sent as kNonFinite (or a peer's garbage)
        for (int64_t i = begin; i < end; ++i) {
          out[i] = (s == 0 ? 0.0f : out[i]) + non_finite_value(code[i]);
        }
      } else if (s == 0) {
        for (int64_t i = begin; i < end; ++i) out[i] = code[i] * scale;
      } else {
        for (int64_t i = begin; i < end; ++i) out[i] += code[i] * scale;
      }
    }
    if (factor != 1.0f) {
      for (int64_t i = begin; i < end; ++i) out[i] *= factor;
    }
  }
}

// The owner's step: out = factor * sum of the sources, requantized (+ its
// error) into `codes`/`scales`, one chunk at a time through an L1-sized
// scratch instead of a float32 average of the whole block written and read
// back. `codes`/`scales` may be one of the sources: each chunk is read
// before it is overwritten.
void average_and_requantize(const std::vector<const int8_t*>& sources,
                            const std::vector<const float*>& source_scales, int64_t n,
                            int64_t chunk, float factor, float* error, int8_t* codes,
                            float* scales) {
  std::vector<float> scratch(static_cast<size_t>(std::min(n, chunk)));
  std::vector<const int8_t*> chunk_codes(sources.size());
  std::vector<const float*> chunk_scales(sources.size());
  for (int64_t c = 0, begin = 0; begin < n; ++c, begin += chunk) {
    const int64_t len = std::min(chunk, n - begin);
    for (size_t s = 0; s < sources.size(); ++s) {
      chunk_codes[s] = sources[s] + begin;
      chunk_scales[s] = source_scales[s] + c;
    }
    dequantize_sum(chunk_codes, chunk_scales, len, chunk, factor, scratch.data());
    quantize(scratch.data(), error ? error + begin : nullptr, len, chunk, codes + begin,
             scales + c);
  }
}

// The elements of chunks [s.offset, s.offset + s.count) of an n-element
// buffer (the last chunk may be short).
Span elements(const Span& s, int64_t chunk, int64_t n) {
  const int64_t begin = std::min(n, s.offset * chunk);
  return {begin, std::min(n, (s.offset + s.count) * chunk) - begin};
}

void reset_if_sized_otherwise(at::Tensor& t, int64_t n) {
  if (!t.defined() || t.numel() != n) t = at::zeros({n}, at::kFloat);
}

}  // namespace

void low_precision_all_reduce(Communicator& comm, at::Tensor& buf, at::ScalarType wire) {
  check_flat_float(buf, "low_precision_all_reduce");
  if (wire != at::kHalf && wire != at::kBFloat16) {
    throw InvalidArgument("cohort: low_precision_all_reduce sends float16 or bfloat16");
  }
  const int p = comm.size();
  buf.div_(p);
  // Even a single rank rounds once, so that the result does not depend on
  // the world size in kind (what a user tests at p = 1 holds at p > 1).
  auto gathered = buf.to(wire);
  if (p > 1 && buf.numel() > 0) {
    CommunicatorPointToPoint transport(comm, kCompressionTagBase);
    auto link = make_link(transport, comm, "low_precision_all_reduce");
    const auto blocks = algorithms::even_spans(buf.numel(), p);
    // Partial sums travel as `wire` and are added in float32.
    algorithms::ring_reduce_scatter(link, buf, buf, blocks, ReduceOp::Sum, wire);
    part(gathered, blocks[comm.rank()]).copy_(part(buf, blocks[comm.rank()]));
    algorithms::ring_all_gather(link, gathered, blocks);
  }
  buf.copy_(gathered);
}

}  // namespace cohort::compression

namespace cohort::compression {
namespace {

// One segment of an int8 all-reduce: chunks [first_chunk, first_chunk +
// chunks) of the tensor, split among the ranks as owners. Each owner's part
// travels as one message: its chunks' float32 scales, then their codes, at a
// 4-byte aligned offset of the segment's byte buffers.
struct Segment {
  std::vector<Span> chunk_blocks;  // owner j's chunks, tensor-wide indices
  std::vector<Span> blocks;        // owner j's elements
  std::vector<int64_t> slot;       // byte offset of owner j's message
  std::vector<int64_t> slot_bytes;
  int64_t owner_error_offset = 0;  // this rank's block in the owner error
};

int64_t message_bytes(const Span& chunks, const Span& elements) {
  return (chunks.count * 4 + elements.count + 3) / 4 * 4;
}

std::vector<Segment> plan_segments(int64_t n, int64_t chunk, int64_t segment_chunks, int p, int r,
                                   int64_t* total_bytes, int64_t* owned) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::vector<Segment> segments;
  *total_bytes = 0;
  *owned = 0;
  for (int64_t first = 0; first < chunks; first += segment_chunks) {
    Segment seg;
    for (auto c : algorithms::even_spans(std::min(segment_chunks, chunks - first), p)) {
      c.offset += first;
      seg.chunk_blocks.push_back(c);
      seg.blocks.push_back(elements(c, chunk, n));
      seg.slot.push_back(*total_bytes);
      seg.slot_bytes.push_back(message_bytes(c, seg.blocks.back()));
      *total_bytes += seg.slot_bytes.back();
    }
    seg.owner_error_offset = *owned;
    *owned += seg.blocks[r].count;
    segments.push_back(std::move(seg));
  }
  return segments;
}

// Views of a message that starts at `base` and carries `chunks` scales.
struct Message {
  float* scales;
  int8_t* codes;
};
Message message_at(uint8_t* base, int64_t chunks) {
  return {reinterpret_cast<float*>(base), reinterpret_cast<int8_t*>(base + 4 * chunks)};
}
// Owner j's message in a segment's slice of a tensor-wide byte buffer.
Message message(const at::Tensor& bytes, const Segment& seg, int j) {
  return message_at(static_cast<uint8_t*>(bytes.data_ptr()) + seg.slot[j],
                    seg.chunk_blocks[j].count);
}

// One int8_all_reduce: its buffers, its posted transfers, and the three
// steps each segment goes through.
class Int8AllReduce {
 public:
  Int8AllReduce(Communicator& comm, at::Tensor& buf, int64_t chunk, Int8ErrorFeedback* feedback,
                int64_t segment_chunks)
      : p_(comm.size()),
        r_(comm.rank()),
        chunk_(chunk),
        transport_(comm, kCompressionTagBase),
        link_(make_link(transport_, comm, "int8_all_reduce")) {
    const int64_t n = buf.numel();
    int64_t total_bytes = 0, owned = 0;
    segments_ = plan_segments(n, chunk, segment_chunks, p_, r_, &total_bytes, &owned);
    if (feedback) {
      reset_if_sized_otherwise(feedback->worker, n);
      reset_if_sized_otherwise(feedback->owner, owned);
    }
    x_ = buf.data_ptr<float>();
    worker_error_ = feedback ? feedback->worker.data_ptr<float>() : nullptr;
    owner_error_ = feedback ? feedback->owner.data_ptr<float>() : nullptr;
    auto bytes = at::TensorOptions().dtype(at::kByte);
    local_ = at::empty({total_bytes}, bytes);
    gathered_ = at::empty({total_bytes}, bytes);
    post_receives();
  }

  // A software pipeline over the segments: segment s is quantized and sent
  // while s-1's chunks are averaged and s-2's averages are on the wire, so
  // the arithmetic and both phases overlap instead of running in turn.
  void run() {
    const size_t count = segments_.size();
    for (size_t s = 0; s < count + 2; ++s) {
      if (s < count) start_phase1(s);
      if (s >= 1 && s - 1 < count) start_phase2(s - 1);
      if (s >= 2) finish(s - 2);
    }
  }

 private:
  at::Tensor slot(const at::Tensor& t, const Segment& seg, int j) const {
    return t.narrow(0, seg.slot[j], seg.slot_bytes[j]);
  }

  // Every receive is posted up front, so no sender waits for a matching
  // receive; tags keep the segments and phases apart.
  void post_receives() {
    const size_t count = segments_.size();
    inbox_.resize(count);
    phase1_.resize(count);
    phase2_.resize(count);
    auto bytes = at::TensorOptions().dtype(at::kByte);
    for (size_t s = 0; s < count; ++s) {
      const auto& seg = segments_[s];
      inbox_[s] = at::empty({p_, seg.slot_bytes[r_]}, bytes);
      for (int i = 0; i < p_; ++i) {
        if (i == r_) continue;
        if (seg.slot_bytes[r_] > 0) {
          phase1_[s].push_back(link_.recv(inbox_[s][i], i, static_cast<int>(2 * s)));
        }
        if (seg.slot_bytes[i] > 0) {
          phase2_[s].push_back(link_.recv(slot(gathered_, seg, i), i, static_cast<int>(2 * s + 1)));
        }
      }
    }
  }

  // Phase 1 of segment s: quantize (+ worker error) and send each owner its
  // chunks, one hop, so they are quantized once.
  void start_phase1(size_t s) {
    const auto& seg = segments_[s];
    for (int j = 0; j < p_; ++j) {
      const auto m = message(local_, seg, j);
      const auto& b = seg.blocks[j];
      quantize(x_ + b.offset, worker_error_ ? worker_error_ + b.offset : nullptr, b.count, chunk_,
               m.codes, m.scales);
      if (j != r_ && seg.slot_bytes[j] > 0) {
        phase1_[s].push_back(link_.send(slot(local_, seg, j), j, static_cast<int>(2 * s)));
      }
    }
  }

  // Phase 2 of segment s: the owner averages its chunks in float32 (ranks in
  // order), requantizes them (+ owner error) in place, and sends them to
  // every rank (an all-gather as direct sends: (p-1)/p of the tensor per
  // rank, as a ring's, without its p-1 dependent steps).
  void start_phase2(size_t s) {
    const auto& seg = segments_[s];
    link_.wait_all(phase1_[s]);
    std::vector<const int8_t*> codes;
    std::vector<const float*> scales;
    for (int i = 0; i < p_; ++i) {
      const auto m = i == r_ ? message(local_, seg, r_)
                             : message_at(static_cast<uint8_t*>(inbox_[s][i].data_ptr()),
                                          seg.chunk_blocks[r_].count);
      codes.push_back(m.codes);
      scales.push_back(m.scales);
    }
    const auto own = message(local_, seg, r_);
    average_and_requantize(codes, scales, seg.blocks[r_].count, chunk_, 1.0f / p_,
                           owner_error_ ? owner_error_ + seg.owner_error_offset : nullptr,
                           own.codes, own.scales);
    for (int j = 0; j < p_; ++j) {
      if (j != r_ && seg.slot_bytes[r_] > 0) {
        phase2_[s].push_back(link_.send(slot(local_, seg, r_), j, static_cast<int>(2 * s + 1)));
      }
    }
  }

  // Segment s's averages are in: every owner's chunks, dequantized into x.
  void finish(size_t s) {
    const auto& seg = segments_[s];
    link_.wait_all(phase2_[s]);
    for (int j = 0; j < p_; ++j) {
      const auto m = message(j == r_ ? local_ : gathered_, seg, j);
      dequantize_sum({m.codes}, {m.scales}, seg.blocks[j].count, chunk_, 1.0f,
                     x_ + seg.blocks[j].offset);
    }
  }

  const int p_, r_;
  const int64_t chunk_;
  CommunicatorPointToPoint transport_;
  Link link_;
  std::vector<Segment> segments_;
  float* x_ = nullptr;
  float* worker_error_ = nullptr;
  float* owner_error_ = nullptr;
  // `local_` holds this rank's quantized chunks (phase 1 sends) and, in its
  // own slots, the requantized average (phase 2 sends); `gathered_` receives
  // the other owners' averages; `inbox_` the other ranks' chunks of ours.
  at::Tensor local_, gathered_;
  std::vector<at::Tensor> inbox_;
  std::vector<std::vector<Link::Pending>> phase1_, phase2_;
};

// Small tensors get smaller chunks, so that every rank owns one (else one
// owner would receive and send the whole tensor).
int64_t effective_chunk(int64_t n, int64_t chunk, int p) {
  return std::min(chunk, (n + p - 1) / p);
}

}  // namespace

void int8_all_reduce(Communicator& comm, at::Tensor& buf, int64_t chunk,
                     Int8ErrorFeedback* feedback, int64_t segment_chunks) {
  check_flat_float(buf, "int8_all_reduce");
  if (chunk < 1 || segment_chunks < 1) {
    throw InvalidArgument("cohort: int8_all_reduce needs chunk >= 1 and segment_chunks >= 1");
  }
  const int p = comm.size();
  const int64_t n = buf.numel();
  if (n == 0) return;
  Int8AllReduce(comm, buf, effective_chunk(n, chunk, p), feedback, segment_chunks).run();
}

std::vector<std::pair<int64_t, int64_t>> int8_owned_elements(int64_t n, int64_t chunk, int rank,
                                                             int size, int64_t segment_chunks) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (n == 0) return out;
  int64_t total_bytes = 0, owned = 0;
  for (const auto& seg : plan_segments(n, effective_chunk(n, chunk, size), segment_chunks, size,
                                       rank, &total_bytes, &owned)) {
    out.emplace_back(seg.blocks[rank].offset, seg.blocks[rank].count);
  }
  return out;
}

}  // namespace cohort::compression
