// defines: the double binary tree all-reduce (Sanders, Speck & Träff 2009;
// NCCL's tree algorithm).
//
// Two binary trees over the ranks, each carrying half of the vector: reduce
// up the tree, broadcast down, pipelined in segments. The second tree is the
// first shifted by one rank, so most leaves of one are inner nodes of the
// other and every rank sends and receives about n bytes in total.
//
// Cost model, p ranks, n bytes, S segments:
//   2 (log2(p) + S) alpha + ~2 n beta   (every link carries its half twice)
// Latency logarithmic in p with pipelined bandwidth; between HD and ring.
// Reduce-scatter and all-gather have no tree form: they run the ring.
#pragma once

#include <vector>

#include "cohort/algorithms/link.h"

namespace cohort::algorithms {

// The in-order binary tree over p positions: parent (-1 at the root) and up
// to two children of position `pos`.
struct TreeNode {
  int parent = -1;
  std::vector<int> children;
};
TreeNode binary_tree_node(int pos, int p);

void tree_all_reduce(Link& link, at::Tensor& buf, ReduceOp op);

}  // namespace cohort::algorithms
