#include "cohort/compression/compressed_collectives.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/algorithms/link.h"
#include "cohort/algorithms/ring.h"
#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"

namespace cohort::compression {
namespace {

using algorithms::Link;
using algorithms::Span;

// A public Work seen as an engine-side WorkImpl (what a Link waits on).
class WorkAdapter : public WorkImpl {
 public:
  explicit WorkAdapter(Work work) : work_(std::move(work)) {}
  bool is_completed() override { return work_.is_completed(); }
  void wait(Millis timeout) override { work_.wait(timeout); }

 private:
  Work work_;
};

// The communicator's tagged point-to-point as an Engine, so that cohort's
// ring algorithms (written over a Link) run on it. Transfers go through the
// Communicator, where they are validated and counted; tags are moved above
// kCompressionTagBase. Collectives are not needed by a Link and refused.
class PointToPointEngine : public Engine {
 public:
  explicit PointToPointEngine(Communicator& comm) : comm_(comm) {}
  std::string name() const override { return "point-to-point over " + comm_.backend(); }
  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }
  WorkPtr send(at::Tensor& t, int dst, int tag) override {
    return std::make_shared<WorkAdapter>(comm_.send(t, dst, {kCompressionTagBase + tag}));
  }
  WorkPtr recv(at::Tensor& t, int src, int tag) override {
    return std::make_shared<WorkAdapter>(comm_.recv(t, src, {kCompressionTagBase + tag}));
  }
  WorkPtr all_reduce(at::Tensor&, ReduceOp) override { unsupported("all_reduce"); }
  WorkPtr broadcast(at::Tensor&, int) override { unsupported("broadcast"); }
  WorkPtr reduce(at::Tensor&, int, ReduceOp) override { unsupported("reduce"); }
  WorkPtr all_gather(std::vector<at::Tensor>&, at::Tensor&) override { unsupported("all_gather"); }
  WorkPtr gather(std::vector<at::Tensor>&, at::Tensor&, int) override { unsupported("gather"); }
  WorkPtr scatter(at::Tensor&, std::vector<at::Tensor>&, int) override { unsupported("scatter"); }
  WorkPtr all_to_all(at::Tensor&, at::Tensor&, std::vector<int64_t>&,
                     std::vector<int64_t>&) override {
    unsupported("all_to_all");
  }
  WorkPtr barrier() override { unsupported("barrier"); }
  std::unique_ptr<Engine> create_subgroup(const std::vector<int>&, std::shared_ptr<Store>,
                                          Millis) override {
    unsupported("create_subgroup");
  }

 private:
  Communicator& comm_;
};

Link make_link(PointToPointEngine& engine, Communicator& comm, const std::string& what) {
  return Link(engine,
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

int64_t largest(const std::vector<Span>& spans) {
  int64_t m = 0;
  for (auto& s : spans) m = std::max(m, s.count);
  return m;
}

// Ring reduce-scatter whose messages are `wire` casts of float32 partial
// sums: step s sends block r-s-1 and adds the received block r-s-2 into
// `buf` in float32, so after p-1 steps block r holds the sum over ranks.
void ring_reduce_scatter_cast(Link& link, at::Tensor& buf, const std::vector<Span>& blocks,
                              at::ScalarType wire) {
  const int p = link.size(), r = link.rank();
  const int right = (r + 1) % p, left = (r - 1 + p) % p;
  const auto opts = buf.options().dtype(wire);
  at::Tensor out = at::empty({largest(blocks)}, opts), in = at::empty({largest(blocks)}, opts);
  for (int s = 0; s < p - 1; ++s) {
    const Span send_block = blocks[(r - s - 1 + 2 * p) % p];
    const Span recv_block = blocks[(r - s - 2 + 2 * p) % p];
    auto staged = out.narrow(0, 0, send_block.count);
    staged.copy_(part(buf, send_block));
    auto landed = in.narrow(0, 0, recv_block.count);
    auto recv = link.recv(landed, left, s);
    auto send = link.send(staged, right, s);
    link.wait(recv);
    part(buf, recv_block).add_(landed);
    link.wait(send);
  }
}

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

// Largest |v| over [begin, end) with v = x (+ error): eight independent
// lanes, so the compiler need not reorder a float reduction to vectorise it.
float chunk_amax(const float* x, const float* error, int64_t begin, int64_t end) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    for (int l = 0; l < 8; ++l) {
      const float v = std::fabs(error ? x[i + l] + error[i + l] : x[i + l]);
      lane[l] = v > lane[l] ? v : lane[l];
    }
  }
  float m = 0;
  for (; i < end; ++i) m = std::max(m, std::fabs(error ? x[i] + error[i] : x[i]));
  for (float l : lane) m = std::max(m, l);
  return m;
}

// Quantizes v = x (+ error) to `codes` with one scale per `chunk` elements;
// with `error` non-null it becomes v - dequantized (what was dropped).
void quantize(const float* x, float* error, int64_t n, int64_t chunk, int8_t* codes,
              float* scales) {
  for (int64_t c = 0, begin = 0; begin < n; ++c, begin += chunk) {
    const int64_t end = std::min(n, begin + chunk);
    const float scale = chunk_amax(x, error, begin, end) / 127.0f;
    const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
    scales[c] = scale;
    for (int64_t i = begin; i < end; ++i) {
      const float v = error ? x[i] + error[i] : x[i];
      const float q = std::min(127.0f, std::max(-127.0f, round_even(v * inverse)));
      codes[i] = static_cast<int8_t>(q);
      if (error) error[i] = v - q * scale;
    }
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
    for (int64_t i = begin; i < end; ++i) out[i] = codes[0][i] * scales[0][c];
    for (size_t s = 1; s < codes.size(); ++s) {
      const float scale = scales[s][c];
      for (int64_t i = begin; i < end; ++i) out[i] += codes[s][i] * scale;
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
    PointToPointEngine engine(comm);
    auto link = make_link(engine, comm, "low_precision_all_reduce");
    const auto blocks = algorithms::even_spans(buf.numel(), p);
    ring_reduce_scatter_cast(link, buf, blocks, wire);
    part(gathered, blocks[comm.rank()]).copy_(part(buf, blocks[comm.rank()]));
    algorithms::ring_all_gather(link, gathered, blocks);
  }
  buf.copy_(gathered);
}

}  // namespace cohort::compression

namespace cohort::compression {

void int8_all_reduce(Communicator& comm, at::Tensor& buf, int64_t chunk,
                     Int8ErrorFeedback* feedback) {
  check_flat_float(buf, "int8_all_reduce");
  if (chunk < 1) throw InvalidArgument("cohort: int8_all_reduce needs chunk >= 1");
  const int p = comm.size(), r = comm.rank();
  const int64_t n = buf.numel();
  if (n == 0) return;
  // Small tensors get smaller chunks, so that every rank owns one (else one
  // owner would receive and send the whole tensor).
  chunk = std::min(chunk, (n + p - 1) / p);
  const int64_t chunks = (n + chunk - 1) / chunk;
  // Chunk-aligned ownership: rank j owns chunks chunk_blocks[j].
  const auto chunk_blocks = algorithms::even_spans(chunks, p);
  std::vector<Span> blocks;
  for (auto& c : chunk_blocks) blocks.push_back(elements(c, chunk, n));
  if (feedback) {
    reset_if_sized_otherwise(feedback->worker, n);
    reset_if_sized_otherwise(feedback->owner, blocks[r].count);
  }
  // codes and scales are the whole tensor's, phase 2 gathers into them.
  at::Tensor codes = at::empty({n}, at::kChar), scales = at::empty({chunks}, at::kFloat);
  quantize(buf.data_ptr<float>(), feedback ? feedback->worker.data_ptr<float>() : nullptr, n, chunk,
           codes.data_ptr<int8_t>(), scales.data_ptr<float>());

  PointToPointEngine engine(comm);
  auto link = make_link(engine, comm, "int8_all_reduce");
  // Phase 1: rank j's chunks go straight to rank j (one hop, so they are
  // quantized once), which sums them in float32.
  std::vector<at::Tensor> in_codes(p), in_scales(p);
  std::vector<Link::Pending> pending;
  for (int i = 0; i < p; ++i) {
    if (i == r) continue;
    in_codes[i] = at::empty({blocks[r].count}, at::kByte);
    in_scales[i] = at::empty({chunk_blocks[r].count}, at::kFloat);
    pending.push_back(link.recv(in_codes[i], i, 0));
    pending.push_back(link.recv(in_scales[i], i, 1));
  }
  auto code_bytes = codes.view(at::kByte);
  for (int j = 0; j < p; ++j) {
    if (j == r) continue;
    pending.push_back(link.send(part(code_bytes, blocks[j]), j, 0));
    pending.push_back(link.send(part(scales, chunk_blocks[j]), j, 1));
  }
  link.wait_all(pending);
  // Phase 2: the owner averages its chunks in float32 (ranks in order),
  // requantizes them (+ owner error) in place into the gathered buffers, and
  // the ring all-gathers the int8 chunks and their scales.
  std::vector<const int8_t*> source_codes;
  std::vector<const float*> source_scales;
  for (int i = 0; i < p; ++i) {
    const bool own = i == r;
    source_codes.push_back(own ? part(codes, blocks[r]).data_ptr<int8_t>()
                               : static_cast<const int8_t*>(in_codes[i].data_ptr()));
    source_scales.push_back(own ? part(scales, chunk_blocks[r]).data_ptr<float>()
                                : in_scales[i].data_ptr<float>());
  }
  average_and_requantize(source_codes, source_scales, blocks[r].count, chunk, 1.0f / p,
                         feedback ? feedback->owner.data_ptr<float>() : nullptr,
                         part(codes, blocks[r]).data_ptr<int8_t>(),
                         part(scales, chunk_blocks[r]).data_ptr<float>());
  algorithms::ring_all_gather(link, code_bytes, blocks);
  algorithms::ring_all_gather(link, scales, chunk_blocks);
  dequantize_sum({codes.data_ptr<int8_t>()}, {scales.data_ptr<float>()}, n, chunk, 1.0f,
                 buf.data_ptr<float>());
}

}  // namespace cohort::compression
