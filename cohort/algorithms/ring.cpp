#include "cohort/algorithms/ring.h"

#include <algorithm>

namespace cohort::algorithms {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

at::Tensor segment(const at::Tensor& t, const Span& block, int64_t seg, int64_t k) {
  const int64_t begin = k * seg;
  return t.narrow(0, block.offset + begin, std::min(seg, block.count - begin));
}

int64_t largest(const std::vector<Span>& blocks) {
  int64_t m = 0;
  for (auto& b : blocks) m = std::max(m, b.count);
  return m;
}

}  // namespace

void ring_reduce_scatter(Link& link, const at::Tensor& src, at::Tensor& work,
                         const std::vector<Span>& blocks, ReduceOp op, at::ScalarType wire) {
  const int p = link.size(), r = link.rank();
  const auto& mine = blocks[r];
  if (p == 1) {
    if (!work.is_same(src)) work.narrow(0, mine.offset, mine.count).copy_(
        src.narrow(0, mine.offset, mine.count));
    return;
  }
  const int right = (r + 1) % p, left = (r - 1 + p) % p;
  const int64_t seg = segment_elements(work);
  // Cast to the wire dtype, each block leaves through its own place in
  // `on_wire` (a rank sends every block but its own once), so no part of it
  // is reused while a send from it may be in flight.
  const bool cast = wire != at::ScalarType::Undefined && wire != work.scalar_type();
  at::Tensor on_wire = cast ? at::empty({work.numel()}, work.options().dtype(wire)) : at::Tensor();
  auto outgoing = [&](const at::Tensor& from, const Span& block, int64_t k) {
    auto segment_out = segment(from, block, seg, k);
    if (!cast) return segment_out;
    auto cast_out = segment(on_wire, block, seg, k);
    cast_out.copy_(segment_out);
    return cast_out;
  };
  // Step s sends block r-s-1 (reduced at step s-1) and receives block
  // r-s-2, so after p-1 steps block r has passed through every rank.
  auto sent_at = [&](int s) { return blocks[(r - s - 1 + 2 * p) % p]; };
  auto received_at = [&](int s) { return blocks[(r - s - 2 + 2 * p) % p]; };
  // Two receive buffers: step s fills one while step s-1's is still being
  // reduced from (all its segments are waited for before step s+1 reuses it).
  const at::Tensor& like = cast ? on_wire : work;
  at::Tensor tmp[2] = {link.scratch(1, largest(blocks), like),
                       link.scratch(2, largest(blocks), like)};
  std::vector<Link::Pending> sends;
  const Span first = sent_at(0);
  for (int64_t k = 0; k < ceil_div(first.count, seg); ++k) {
    sends.push_back(link.send(outgoing(src, first, k), right, static_cast<int>(k)));
  }
  for (int s = 0; s < p - 1; ++s) {
    const Span in = received_at(s);
    const Span staged{0, in.count};
    const int64_t segs = ceil_div(in.count, seg);
    std::vector<Link::Pending> recvs;
    for (int64_t k = 0; k < segs; ++k) {
      recvs.push_back(link.recv(segment(tmp[s % 2], staged, seg, k), left, static_cast<int>(k)));
    }
    for (int64_t k = 0; k < segs; ++k) {
      link.wait(recvs[k]);
      auto out = segment(work, in, seg, k);
      reduce_into(out, segment(src, in, seg, k), segment(tmp[s % 2], staged, seg, k), op);
      // Forward at once: this block is what step s+1 sends.
      if (s + 1 < p - 1)
        sends.push_back(link.send(outgoing(work, in, k), right, static_cast<int>(k)));
    }
  }
  link.wait_all(sends);
}

void ring_all_gather(Link& link, at::Tensor& buf, const std::vector<Span>& blocks) {
  const int p = link.size(), r = link.rank();
  if (p == 1) return;
  const int right = (r + 1) % p, left = (r - 1 + p) % p;
  const int64_t seg = segment_elements(buf);
  // Step s forwards block r-s and receives block r-s-1. Destinations are
  // disjoint, so every receive is posted up front, straight into `buf`.
  std::vector<std::vector<Link::Pending>> recvs(static_cast<size_t>(p - 1));
  for (int s = 0; s < p - 1; ++s) {
    const Span in = blocks[(r - s - 1 + p) % p];
    for (int64_t k = 0; k < ceil_div(in.count, seg); ++k) {
      recvs[s].push_back(link.recv(segment(buf, in, seg, k), left, static_cast<int>(k)));
    }
  }
  std::vector<Link::Pending> sends;
  const Span own = blocks[r];
  for (int64_t k = 0; k < ceil_div(own.count, seg); ++k) {
    sends.push_back(link.send(segment(buf, own, seg, k), right, static_cast<int>(k)));
  }
  for (int s = 0; s < p - 1; ++s) {
    const Span in = blocks[(r - s - 1 + p) % p];
    for (size_t k = 0; k < recvs[s].size(); ++k) {
      link.wait(recvs[s][k]);
      if (s + 1 < p - 1) {
        sends.push_back(
            link.send(segment(buf, in, seg, static_cast<int64_t>(k)), right, static_cast<int>(k)));
      }
    }
  }
  link.wait_all(sends);
}

void ring_all_reduce(Link& link, at::Tensor& buf, ReduceOp op) {
  const auto blocks = even_spans(buf.numel(), link.size());
  ring_reduce_scatter(link, buf, buf, blocks, op);
  ring_all_gather(link, buf, blocks);
}

}  // namespace cohort::algorithms
