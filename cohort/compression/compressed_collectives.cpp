#include "cohort/compression/compressed_collectives.h"

#include <algorithm>
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

// One float32 scale per `chunk` elements (the chunk's largest magnitude over
// 127) and the int8 codes round(x / scale); a chunk of zeros gets scale 0.
void quantize(const at::Tensor& x, int64_t chunk, at::Tensor& codes, at::Tensor& scales) {
  const int64_t n = x.numel(), chunks = (n + chunk - 1) / chunk;
  auto padded = at::constant_pad_nd(x, {0, chunks * chunk - n}).view({chunks, chunk});
  scales = padded.abs().amax(1).div_(127);
  auto inverse = at::where(scales > 0, scales.reciprocal(), at::zeros_like(scales));
  codes = padded.mul(inverse.unsqueeze(1))
              .round_()
              .clamp_(-127, 127)
              .to(at::kChar)
              .view(-1)
              .narrow(0, 0, n)
              .contiguous();
}

at::Tensor dequantize(const at::Tensor& codes, const at::Tensor& scales, int64_t chunk) {
  const int64_t n = codes.numel(), chunks = scales.numel();
  auto padded = at::constant_pad_nd(codes.to(at::kFloat), {0, chunks * chunk - n});
  return padded.view({chunks, chunk}).mul_(scales.unsqueeze(1)).view(-1).narrow(0, 0, n);
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
  at::Tensor x = buf;
  if (feedback) {
    reset_if_sized_otherwise(feedback->worker, n);
    reset_if_sized_otherwise(feedback->owner, blocks[r].count);
    x = buf.add(feedback->worker);
  }
  at::Tensor codes, scales;
  quantize(x, chunk, codes, scales);
  if (feedback) feedback->worker = x - dequantize(codes, scales, chunk);

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
  at::Tensor sum = dequantize(part(codes, blocks[r]), part(scales, chunk_blocks[r]), chunk);
  for (int i = 0; i < p; ++i) {
    if (i != r) sum.add_(dequantize(in_codes[i].view(at::kChar), in_scales[i], chunk));
  }
  // Phase 2: the owner requantizes the average of its chunks and the ring
  // all-gathers the int8 chunks and their scales.
  at::Tensor average = sum.div_(p);
  if (feedback) average.add_(feedback->owner);
  at::Tensor own_codes, own_scales;
  quantize(average, chunk, own_codes, own_scales);
  if (feedback) feedback->owner = average - dequantize(own_codes, own_scales, chunk);
  at::Tensor all_codes = at::empty({n}, at::kByte), all_scales = at::empty({chunks}, at::kFloat);
  part(all_codes, blocks[r]).copy_(own_codes.view(at::kByte));
  part(all_scales, chunk_blocks[r]).copy_(own_scales);
  algorithms::ring_all_gather(link, all_codes, blocks);
  algorithms::ring_all_gather(link, all_scales, chunk_blocks);
  buf.copy_(dequantize(all_codes.view(at::kChar), all_scales, chunk));
}

}  // namespace cohort::compression
