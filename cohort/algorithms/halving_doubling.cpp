#include "cohort/algorithms/halving_doubling.h"

namespace cohort::algorithms {
namespace {

// Who takes part in the power-of-two phase, and as which index.
struct Fold {
  int p2 = 1;   // participants
  int rem = 0;  // p - p2 ranks sit out
  Fold(int p) {
    while (p2 * 2 <= p) p2 *= 2;
    rem = p - p2;
  }
  // Index among participants, -1 for an even rank below 2 rem (it sits out).
  int index(int r) const {
    if (r < 2 * rem) return r % 2 ? r / 2 : -1;
    return r - rem;
  }
  int rank_of(int i) const { return i < rem ? 2 * i + 1 : i + rem; }
};

struct Range {
  int lo = 0, hi = 0;  // blocks [lo, hi)
};

// The block ranges participant i holds after each halving step: [0] is all
// blocks, [k] after k steps. Every rank can compute any participant's.
std::vector<Range> halving_ranges(int i, int p2, int blocks) {
  std::vector<Range> ranges{{0, blocks}};
  for (int d = p2 / 2; d >= 1; d /= 2) {
    Range r = ranges.back();
    const int mid = r.lo + (r.hi - r.lo) / 2;
    ranges.push_back((i & d) ? Range{mid, r.hi} : Range{r.lo, mid});
  }
  return ranges;
}

at::Tensor view(const at::Tensor& t, const std::vector<Span>& blocks, Range r) {
  if (r.lo >= r.hi) return t.narrow(0, 0, 0);
  const int64_t begin = blocks[r.lo].offset;
  const int64_t end = blocks[r.hi - 1].offset + blocks[r.hi - 1].count;
  return t.narrow(0, begin, end - begin);
}

// The sitting-out even rank hands its vector to its odd partner, which
// reduces it in. Returns this rank's participant index (or -1).
int fold_in(Link& link, const Fold& f, at::Tensor& work, ReduceOp op) {
  const int r = link.rank();
  const int i = f.index(r);
  if (r >= 2 * f.rem) return i;
  if (i < 0) {
    exchange(link, r + 1, work, {});
    return i;
  }
  auto tmp = link.scratch(1, work.numel(), work);
  exchange(link, r - 1, {}, tmp, [&](int64_t off, int64_t len) {
    auto w = work.narrow(0, off, len);
    reduce_into(w, w, tmp.narrow(0, off, len), op);
  });
  return i;
}

// Recursive halving: participant i ends holding range ranges.back(), reduced.
void halve(Link& link, const Fold& f, int i, at::Tensor& work, const std::vector<Span>& blocks,
           ReduceOp op) {
  const auto mine = halving_ranges(i, f.p2, static_cast<int>(blocks.size()));
  at::Tensor tmp;
  int level = 1;
  for (int d = f.p2 / 2; d >= 1; d /= 2, ++level) {
    const Range keep = mine[level];
    const Range whole = mine[level - 1];
    const Range give = keep.lo == whole.lo ? Range{keep.hi, whole.hi} : Range{whole.lo, keep.lo};
    auto in_view = view(work, blocks, keep);
    if (!tmp.defined()) tmp = link.scratch(1, in_view.numel(), work);
    auto staged = tmp.narrow(0, 0, in_view.numel());
    exchange(link, f.rank_of(i ^ d), view(work, blocks, give), staged,
             [&](int64_t off, int64_t len) {
               auto w = in_view.narrow(0, off, len);
               reduce_into(w, w, staged.narrow(0, off, len), op);
             });
  }
}

// Recursive doubling: the reverse of halve, without reduction.
void double_up(Link& link, const Fold& f, int i, at::Tensor& buf,
               const std::vector<Span>& blocks) {
  const int nb = static_cast<int>(blocks.size());
  const auto mine = halving_ranges(i, f.p2, nb);
  int level = static_cast<int>(mine.size()) - 1;
  for (int d = 1; d < f.p2; d *= 2, --level) {
    const int partner = i ^ d;
    const Range theirs = halving_ranges(partner, f.p2, nb)[level];
    exchange(link, f.rank_of(partner), view(buf, blocks, mine[level]), view(buf, blocks, theirs));
  }
}

// The participant holding block b after the halving.
int holder(const Fold& f, int b, int nb) {
  for (int i = 0; i < f.p2; ++i) {
    const Range r = halving_ranges(i, f.p2, nb).back();
    if (b >= r.lo && b < r.hi) return f.rank_of(i);
  }
  return -1;
}

}  // namespace

void hd_all_reduce(Link& link, at::Tensor& buf, ReduceOp op) {
  const int p = link.size(), r = link.rank();
  if (p == 1) return;
  const Fold f(p);
  const auto blocks = even_spans(buf.numel(), f.p2);
  const int i = fold_in(link, f, buf, op);
  if (i >= 0) {
    halve(link, f, i, buf, blocks, op);
    double_up(link, f, i, buf, blocks);
  }
  // The odd partner hands the result back.
  if (r < 2 * f.rem) {
    if (i >= 0) {
      exchange(link, r - 1, buf, {});
    } else {
      exchange(link, r + 1, {}, buf);
    }
  }
}

void hd_reduce_scatter(Link& link, at::Tensor& work, const std::vector<Span>& blocks,
                       ReduceOp op) {
  const int p = link.size(), r = link.rank();
  if (p == 1) return;
  const Fold f(p);
  const int i = fold_in(link, f, work, op);
  if (i >= 0) halve(link, f, i, work, blocks, op);
  // Each participant now holds one or two reduced blocks: deliver them, all
  // at once (receive posted first), so no chain of sends can wait in a cycle.
  std::vector<Link::Pending> pending;
  const int from = holder(f, r, p);
  if (from != r) pending.push_back(link.recv(view(work, blocks, {r, r + 1}), from, 0));
  if (i >= 0) {
    const Range held = halving_ranges(i, f.p2, p).back();
    for (int b = held.lo; b < held.hi; ++b) {
      if (b != r) pending.push_back(link.send(view(work, blocks, {b, b + 1}), b, 0));
    }
  }
  link.wait_all(pending);
}

void hd_all_gather(Link& link, at::Tensor& buf, const std::vector<Span>& blocks) {
  const int p = link.size(), r = link.rank();
  if (p == 1) return;
  const Fold f(p);
  const int i = f.index(r);
  // Every block goes to the participant that holds it in the doubling.
  std::vector<Link::Pending> pending;
  if (i >= 0) {
    const Range held = halving_ranges(i, f.p2, p).back();
    for (int b = held.lo; b < held.hi; ++b) {
      if (b != r) pending.push_back(link.recv(view(buf, blocks, {b, b + 1}), b, 0));
    }
  }
  const int to = holder(f, r, p);
  if (to != r) pending.push_back(link.send(view(buf, blocks, {r, r + 1}), to, 0));
  link.wait_all(pending);
  if (i >= 0) double_up(link, f, i, buf, blocks);
  if (r < 2 * f.rem) {
    if (i >= 0) {
      exchange(link, r - 1, buf, {});
    } else {
      exchange(link, r + 1, {}, buf);
    }
  }
}

}  // namespace cohort::algorithms
