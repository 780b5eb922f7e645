#include "cohort/algorithms/double_binary_tree.h"

#include <algorithm>

namespace cohort::algorithms {

TreeNode binary_tree_node(int pos, int p) {
  // Root of [lo, hi) is its middle; left subtree [lo, mid), right [mid+1, hi).
  TreeNode node;
  int lo = 0, hi = p, parent = -1;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (mid == pos) {
      node.parent = parent;
      if (lo < mid) node.children.push_back(lo + (mid - lo) / 2);
      if (mid + 1 < hi) node.children.push_back(mid + 1 + (hi - mid - 1) / 2);
      return node;
    }
    parent = mid;
    if (pos < mid) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return node;
}

namespace {

// One tree's share of the vector and this rank's place in it (as ranks).
struct TreeJob {
  int index = 0;  // 0 or 1: tags tell the trees apart
  at::Tensor data;
  int parent = -1;
  std::vector<int> children;
  std::vector<at::Tensor> from_child;  // one staging buffer per child
  at::Tensor from_parent;
  std::vector<std::vector<Link::Pending>> up;  // [child][segment]
  std::vector<Link::Pending> down;             // [segment]
};

// Tags: segment k of tree t going up (reduce) or down (broadcast).
int tag(int64_t k, int tree, bool down) {
  return static_cast<int>(((k * 2 + tree) << 1) | (down ? 1 : 0));
}

}  // namespace

void tree_all_reduce(Link& link, at::Tensor& buf, ReduceOp op) {
  const int p = link.size(), r = link.rank();
  if (p == 1) return;
  const int64_t n = buf.numel();
  const int64_t seg = segment_elements(buf);
  // Tree 0 places rank r at position r; tree 1 at position r-1 (mod p).
  TreeJob trees[2];
  const int64_t half = n / 2;
  for (int t = 0; t < 2; ++t) {
    auto& job = trees[t];
    job.index = t;
    job.data = t == 0 ? buf.narrow(0, 0, half) : buf.narrow(0, half, n - half);
    const int pos = (r - t + p) % p;
    const auto node = binary_tree_node(pos, p);
    auto rank_at = [&](int q) { return (q + t) % p; };
    job.parent = node.parent < 0 ? -1 : rank_at(node.parent);
    for (int c : node.children) job.children.push_back(rank_at(c));
  }
  std::vector<Link::Pending> sends;
  auto segs = [&](const at::Tensor& d) { return (d.numel() + seg - 1) / seg; };
  auto part = [&](const at::Tensor& d, int64_t k) {
    return d.narrow(0, k * seg, std::min(seg, d.numel() - k * seg));
  };
  // Every receive is posted before anything is sent.
  int slot = 1;  // scratch slots: one per child and tree, one per tree for the parent
  for (auto& job : trees) {
    for (int c : job.children) {
      job.from_child.push_back(link.scratch(slot++, job.data.numel(), job.data));
      job.up.emplace_back();
      for (int64_t k = 0; k < segs(job.data); ++k) {
        job.up.back().push_back(link.recv(part(job.from_child.back(), k), c, tag(k, job.index, false)));
      }
    }
    if (job.parent >= 0) {
      // The broadcast lands beside `data`: `data` may still be on its way up.
      job.from_parent = link.scratch(slot++, job.data.numel(), job.data);
      for (int64_t k = 0; k < segs(job.data); ++k) {
        job.down.push_back(link.recv(part(job.from_parent, k), job.parent, tag(k, job.index, true)));
      }
    }
  }
  // Reduce: segment by segment, both trees interleaved; the root turns each
  // reduced segment around at once.
  const int64_t most = std::max(segs(trees[0].data), segs(trees[1].data));
  for (int64_t k = 0; k < most; ++k) {
    for (auto& job : trees) {
      if (k >= segs(job.data)) continue;
      auto mine = part(job.data, k);
      for (size_t c = 0; c < job.children.size(); ++c) {
        link.wait(job.up[c][k]);
        reduce_into(mine, mine, part(job.from_child[c], k), op);
      }
      if (job.parent >= 0) {
        sends.push_back(link.send(mine, job.parent, tag(k, job.index, false)));
      } else {
        for (int c : job.children) sends.push_back(link.send(mine, c, tag(k, job.index, true)));
      }
    }
  }
  // Broadcast: each segment from the parent is kept and passed on.
  for (int64_t k = 0; k < most; ++k) {
    for (auto& job : trees) {
      if (k >= segs(job.data) || job.parent < 0) continue;
      link.wait(job.down[k]);
      auto mine = part(job.data, k);
      mine.copy_(part(job.from_parent, k));
      for (int c : job.children) sends.push_back(link.send(mine, c, tag(k, job.index, true)));
    }
  }
  link.wait_all(sends);
}

}  // namespace cohort::algorithms
