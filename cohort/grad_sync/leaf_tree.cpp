// LeafTree and LeafReduction: the canonical tree, the local subtree sums and
// the cross-rank stage that completes the same tree on every chunk.
#include "cohort/grad_sync/leaf_tree.h"

#include <algorithm>
#include <functional>
#include <map>

#include "cohort/core/error.h"

namespace cohort {

LeafTree::LeafTree(int64_t leaves) : leaves_(leaves) {
  if (leaves < 1 || leaves > 65536) {
    throw InvalidArgument("LeafTree: the leaf count must be in [1, 65536], got " +
                          std::to_string(leaves));
  }
  leaf_nodes_.assign(static_cast<size_t>(leaves), -1);
  build(0, leaves, -1);
}

int LeafTree::build(int64_t lo, int64_t hi, int parent) {
  const int id = static_cast<int>(nodes_.size());
  nodes_.push_back({lo, hi, -1, -1, parent});
  const int64_t n = hi - lo;
  if (n == 1) {
    leaf_nodes_[static_cast<size_t>(lo)] = id;
    return id;
  }
  int64_t left = 1;
  while (left * 2 < n) left *= 2;  // the largest power of two below n
  const int l = build(lo, lo + left, id);
  const int r = build(lo + left, hi, id);
  nodes_[static_cast<size_t>(id)].left = l;
  nodes_[static_cast<size_t>(id)].right = r;
  return id;
}

std::vector<int> LeafTree::frontier(int64_t lo, int64_t hi) const {
  std::vector<int> out;
  std::function<void(int)> visit = [&](int id) {
    const auto& node = nodes_[static_cast<size_t>(id)];
    if (node.hi <= lo || node.lo >= hi) return;
    if (node.lo >= lo && node.hi <= hi) {
      out.push_back(id);
      return;
    }
    visit(node.left);
    visit(node.right);
  };
  visit(0);
  return out;
}

LeafReduction::LeafReduction(int64_t leaves, int rank, int world, const std::string& what)
    : tree_(leaves), what_(what), rank_(rank), world_(world) {
  if (world < 1 || leaves % world != 0) {
    throw InvalidArgument(what + ": determinism WorldSizeInvariant needs the world size (" +
                          std::to_string(world) + ") to divide the leaf count (" +
                          std::to_string(leaves) + ") (rank " + std::to_string(rank) + ")");
  }
  count_ = leaves / world;
  first_ = count_ * rank;
  for (int r = 0; r < world; ++r) {
    frontiers_.push_back(tree_.frontier(count_ * r, count_ * (r + 1)));
    max_frontier_ = std::max(max_frontier_, frontiers_.back().size());
  }
  // push()'s merges, on node ids only: where each leaf's sum ends up.
  const auto& nodes = tree_.nodes();
  std::vector<int> stack;
  for (int64_t k = 0; k < count_; ++k) {
    int id = tree_.leaf_node(first_ + k);
    Fold f;
    while (true) {
      const int parent = nodes[static_cast<size_t>(id)].parent;
      if (parent < 0 || nodes[static_cast<size_t>(parent)].right != id) break;
      const auto& p = nodes[static_cast<size_t>(parent)];
      if (p.lo < first_ || p.hi > first_ + count_) break;
      stack.pop_back();
      ++f.merges;
      id = parent;
    }
    f.slot = static_cast<int64_t>(stack.size());
    stack.push_back(id);
    folds_.push_back(f);
    slots_ = std::max(slots_, static_cast<int64_t>(stack.size()));
  }
}

void LeafReduction::check_next_leaf() const {
  if (pushed_ >= count_) {
    throw InvalidArgument(what_ + ": rank " + std::to_string(rank_) + " got a gradient for leaf " +
                          std::to_string(first_ + pushed_) + " but owns only " +
                          std::to_string(count_) + " leaves per step");
  }
}

void LeafReduction::count_folded() {
  check_next_leaf();
  ++pushed_;
}

void LeafReduction::abandon() {
  pushed_ = 0;
  stack_.clear();
}

void LeafReduction::restart() {
  if (pushed_ != count_) {
    throw InvalidArgument(what_ + ": rank " + std::to_string(rank_) + " finished a step after " +
                          std::to_string(pushed_) + " of its " + std::to_string(count_) +
                          " leaves");
  }
  pushed_ = 0;
  stack_.clear();
}

void LeafReduction::push(torch::Tensor flat) {
  check_next_leaf();
  if (!stack_.empty() && (flat.numel() != stack_.front().second.numel() ||
                          flat.scalar_type() != stack_.front().second.scalar_type())) {
    throw InvalidArgument(what_ + ": rank " + std::to_string(rank_) +
                          ": a leaf gradient differs in size or dtype from the step's first");
  }
  const auto& nodes = tree_.nodes();
  int id = tree_.leaf_node(first_ + pushed_);
  ++pushed_;
  torch::NoGradGuard no_grad;
  // Leaves arrive in order, so when a right child is complete its left
  // sibling is the entry below it: merge while the parent is still local.
  while (true) {
    const int parent = nodes[static_cast<size_t>(id)].parent;
    if (parent < 0 || nodes[static_cast<size_t>(parent)].right != id) break;
    const auto& p = nodes[static_cast<size_t>(parent)];
    if (p.lo < first_ || p.hi > first_ + count_) break;
    auto left = std::move(stack_.back());
    stack_.pop_back();
    flat = torch::add(left.second, flat);  // left + right: the canonical operand order
    id = parent;
  }
  stack_.emplace_back(id, std::move(flat));
}

torch::Tensor LeafReduction::complete_chunk(const torch::Tensor& received,
                                            torch::Tensor* out) const {
  // received[s][k]: chunk of rank s's k-th subtree sum.
  std::map<int, torch::Tensor> known;
  for (int s = 0; s < world_; ++s) {
    for (size_t k = 0; k < frontiers_[static_cast<size_t>(s)].size(); ++k) {
      known[frontiers_[static_cast<size_t>(s)][k]] =
          received.select(0, s).select(0, static_cast<int64_t>(k));
    }
  }
  const auto& nodes = tree_.nodes();
  // Each sum is written over its left operand, which is (held in) a part of
  // `received` that nothing reads again: no buffer per addition. The root's
  // goes straight into `out`. Out-of-place or not, add is the same kernel.
  std::function<torch::Tensor(int)> sum = [&](int id) -> torch::Tensor {
    auto it = known.find(id);
    if (it != known.end()) return it->second;
    const auto& node = nodes[static_cast<size_t>(id)];
    auto left = sum(node.left);
    auto right = sum(node.right);
    if (id == 0 && out) return at::add_out(*out, left, right);
    return at::add_out(left, left, right);
  };
  auto root = sum(0);
  if (out && !root.is_same(*out)) out->copy_(root);
  return root;
}

void LeafReduction::complete_into(const torch::Tensor& received, torch::Tensor& out) const {
  torch::NoGradGuard no_grad;
  complete_chunk(received, &out);
  out.div_(static_cast<double>(tree_.leaves()));
}

torch::Tensor LeafReduction::finish(Communicator& comm) {
  const int64_t n = pushed_ > 0 ? stack_.front().second.numel() : 0;
  auto mean = finish_chunk(comm);
  if (world_ == 1) return mean;
  auto gathered = torch::empty({world_ * mean.numel()}, mean.options());
  comm.all_gather_into_tensor(gathered, mean).wait();
  return gathered.narrow(0, 0, n);
}

torch::Tensor LeafReduction::finish_chunk(Communicator& comm) {
  if (pushed_ != count_ || comm.size() != world_) {
    throw InvalidArgument(what_ + ": rank " + std::to_string(rank_) + " finished a step after " +
                          std::to_string(pushed_) + " of its " + std::to_string(count_) +
                          " leaves (world " + std::to_string(comm.size()) + ", expected " +
                          std::to_string(world_) + ")");
  }
  torch::NoGradGuard no_grad;
  const double leaves = static_cast<double>(tree_.leaves());
  std::vector<std::pair<int, torch::Tensor>> mine;
  std::swap(mine, stack_);
  pushed_ = 0;
  if (world_ == 1) return mine.front().second.div(leaves);
  const int64_t n = mine.front().second.numel();
  const int64_t chunk = chunk_numel(n);
  const auto m = static_cast<int64_t>(max_frontier_);
  // send[j][k]: chunk j of this rank's k-th subtree sum (zero padded).
  auto send = torch::zeros({world_, m, chunk}, mine.front().second.options());
  auto padded = torch::zeros({world_ * chunk}, send.options());
  for (size_t k = 0; k < mine.size(); ++k) {
    padded.narrow(0, 0, n).copy_(mine[k].second);
    send.select(1, static_cast<int64_t>(k)).copy_(padded.view({world_, chunk}));
  }
  auto received = torch::empty_like(send);
  comm.all_to_all_single(received, send).wait();
  return complete_chunk(received).div(leaves).contiguous();
}

}  // namespace cohort
