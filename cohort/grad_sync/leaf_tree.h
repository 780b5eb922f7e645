// defines: Determinism, LeafTree (the canonical summation tree over a global
// batch's leaves) and LeafReduction (one rank's part of a world-size
// invariant gradient mean: local subtrees, then the cross-rank stage that
// completes the same tree). Design: cohort/grad_sync/README.md.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

/// How a gradient mean over ranks may order its floating-point additions.
enum class Determinism {
  /// Whatever order the collective algorithm finds fastest (ring, tree, ...):
  /// the bits depend on the world size and the algorithm.
  Default,
  /// The global batch is split into a fixed number of leaves; every gradient
  /// is the sum of the leaves' gradients in one canonical binary tree over
  /// the leaf index, divided by the leaf count. The result is the same bits at
  /// every world size that divides the leaf count (conditions in the README).
  WorldSizeInvariant,
};

/// The canonical binary tree over leaves [0, L): a node of n >= 2 leaves
/// splits at the largest power of two below n (left) and the rest (right), so
/// ranges of 2^k leaves starting at multiples of 2^k are nodes, and so are
/// the ranks' ranges for L = 8 at worlds 1, 2, 4, 8 and L = 12 at 1, 3, 6.
class LeafTree {
 public:
  /// One node: leaves [lo, hi); children and parent are indices (-1: none).
  struct Node {
    int64_t lo = 0;   ///< first leaf
    int64_t hi = 0;   ///< one past the last leaf
    int left = -1;    ///< left child (leaves [lo, lo + 2^k)), -1 for a leaf
    int right = -1;   ///< right child, -1 for a leaf
    int parent = -1;  ///< -1 for the root
  };

  /// Throws InvalidArgument unless 1 <= leaves <= 65536.
  explicit LeafTree(int64_t leaves);
  /// L.
  int64_t leaves() const { return leaves_; }
  /// Every node; node 0 is the root.
  const std::vector<Node>& nodes() const { return nodes_; }
  /// The node of leaf i.
  int leaf_node(int64_t i) const { return leaf_nodes_.at(static_cast<size_t>(i)); }
  /// The maximal nodes inside [lo, hi), left to right: the subtrees a rank
  /// owning those leaves sums by itself (they tile the range).
  std::vector<int> frontier(int64_t lo, int64_t hi) const;

 private:
  int build(int64_t lo, int64_t hi, int parent);

  int64_t leaves_;
  std::vector<Node> nodes_;
  std::vector<int> leaf_nodes_;
};

/// One rank's part of the world-size invariant mean: push() its leaves'
/// flat gradients in leaf order (it sums the completed local subtrees at
/// once, so at most about log2(L) partial sums are held), then finish()
/// completes the tree with the other ranks and returns the mean.
class LeafReduction {
 public:
  /// Rank `rank` of `world` owns leaves [rank * L / world, (rank + 1) * L / world).
  /// Throws InvalidArgument (naming `what` and the rank) unless world divides L.
  LeafReduction(int64_t leaves, int rank, int world, const std::string& what);
  /// L.
  int64_t leaves() const { return tree_.leaves(); }
  /// This rank's first leaf.
  int64_t first_leaf() const { return first_; }
  /// How many leaves this rank computes per step (L / world).
  int64_t local_leaves() const { return count_; }
  /// How many of them were pushed since the last finish().
  int64_t pushed() const { return pushed_; }
  /// The next leaf's gradient, a flat tensor of the same numel and dtype as
  /// the others (InvalidArgument otherwise, or after the last local leaf).
  void push(torch::Tensor flat);
  /// Collective over comm (size() == world): the sum over all L leaves in the
  /// canonical tree, divided by L; the same bits on every rank and at every
  /// world size. Cross-rank stage: every rank sends, for each of its subtree
  /// sums, chunk j to rank j (one all_to_all_single); rank j completes the
  /// tree on chunk j and divides; an all-gather assembles the mean. At aligned
  /// world sizes (one subtree per rank) that is the bytes of a ring all-reduce.
  torch::Tensor finish(Communicator& comm);
  /// Collective, as finish() but without the all-gather: this rank's chunk of
  /// the mean, elements [rank * c, (rank + 1) * c) of the mean zero padded to
  /// world * c, c = ceil(numel / world) (chunk_numel()). The bits of each
  /// element are finish()'s, so a shard owner (ZeRO-2, FSDP) keeps them as
  /// its gradient shard when its shards are these chunks.
  torch::Tensor finish_chunk(Communicator& comm);
  /// The chunk finish_chunk() returns for a gradient of `numel` elements.
  int64_t chunk_numel(int64_t numel) const { return (numel + world_ - 1) / world_; }

  /// For a caller that keeps the partial sums itself, in numbered slots (DDP
  /// folds each parameter's gradient as backward produces it): where local
  /// leaf k's gradient goes. merges == 0: it is copied into `slot`; else it
  /// is added into slot + merges - 1, that slot into the one below, and so
  /// on down to `slot`: each addition is left + right of the canonical tree,
  /// as push() adds.
  struct Fold {
    int64_t slot = 0;    ///< where the leaf's subtree sum ends
    int64_t merges = 0;  ///< completed left siblings it is added to
  };
  /// fold() of local leaf k, 0 <= k < local_leaves().
  const Fold& fold(int64_t k) const { return folds_.at(static_cast<size_t>(k)); }
  /// The slots fold() uses: the most partial sums held at once.
  int64_t slots() const { return slots_; }
  /// Counts the next local leaf as pushed when the caller folded it by
  /// fold() instead of push() (InvalidArgument after the last local leaf).
  void count_folded();
  /// After the last leaf: slots [0, frontier_size()) hold this rank's
  /// subtree sums, left to right.
  int64_t frontier_size() const {
    return static_cast<int64_t>(frontiers_[static_cast<size_t>(rank_)].size());
  }
  /// The most subtree sums any rank holds (the exchange's m).
  int64_t max_frontier() const { return static_cast<int64_t>(max_frontier_); }
  /// finish_chunk()'s completion for a caller that exchanged the subtree sums
  /// itself: received[s][k] is (a chunk of) rank s's k-th subtree sum, a
  /// [world, max_frontier(), c] tensor; writes the tree's sum divided by L
  /// into `out` (c elements). The same bits as finish_chunk()'s elements.
  /// Overwrites `received` (partial sums are kept in it).
  void complete_into(const torch::Tensor& received, torch::Tensor& out) const;
  /// Ends a step whose leaves were all counted by count_folded().
  void restart();
  /// Drops the leaves pushed or folded since the last finish() (a step
  /// abandoned): the next push is the rank's first leaf again.
  void abandon();

 private:
  // Overwrites `received`.
  torch::Tensor complete_chunk(const torch::Tensor& received, torch::Tensor* out = nullptr) const;
  void check_next_leaf() const;

  LeafTree tree_;
  std::string what_;
  int rank_;
  int world_;
  int64_t first_;
  int64_t count_;
  int64_t pushed_ = 0;
  /// Each rank's frontier, and its position in the exchange.
  std::vector<std::vector<int>> frontiers_;
  size_t max_frontier_ = 0;
  /// Completed local subtrees not yet merged: (node, sum).
  std::vector<std::pair<int, torch::Tensor>> stack_;
  /// fold() per local leaf, and the slots they use.
  std::vector<Fold> folds_;
  int64_t slots_ = 0;
};

}  // namespace cohort
