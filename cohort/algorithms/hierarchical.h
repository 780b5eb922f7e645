// defines: Topology (which ranks share a node) and Hierarchy, the
// hierarchical all-reduce: reduce inside each node, all-reduce among the
// node leaders (the engine's own), broadcast inside each node.
//
// Cost model, N nodes of L ranks, n bytes, intra-node (a_i, b_i) and
// inter-node (a_x, b_x) links:
//   2 log2(L) a_i + 2 n b_i  +  2(N-1) a_x + 2(N-1)/N n b_x
// Only N ranks touch the slow links, each carrying 2(N-1)/N n bytes, against
// 2(p-1)/p n over every slow link of a flat ring: the choice when the links
// between nodes are much slower than those inside them.
//
// Nodes: CommunicatorOptions::node (init() fills it from COHORT_NODE_ID, or
// the host name and GROUP_RANK, cohortrun's node index), else the host name;
// every rank publishes its key in the store and reads the others'.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cohort/algorithms/link.h"
#include "cohort/core/store/store.h"

namespace cohort::algorithms {

struct Topology {
  std::vector<int> node_of;  // node index of every rank, by first appearance
  int nodes = 1;
};

// This rank's node key: `configured` if set, else the host name.
std::string local_node_key(const std::string& configured);
std::string host_name();
Topology exchange_topology(Store& store, int rank, int size, const std::string& key,
                           Millis timeout);

class Hierarchy {
 public:
  // Pipeline chunks: about this many bytes each, at most kMaxChunks.
  static constexpr int64_t kChunkBytes = 2 << 20;
  static constexpr int64_t kMaxChunks = 16;
  // Every rank of `engine` calls it; `store` is the group's key space.
  Hierarchy(Engine& engine, const std::shared_ptr<Store>& store, const Topology& topo,
            Millis timeout);
  void all_reduce(Link& link, at::Tensor& buf, ReduceOp op);

 private:
  std::unique_ptr<Engine> node_;     // the ranks of this node, leader first
  std::unique_ptr<Engine> leaders_;  // node leaders only; null elsewhere
};

}  // namespace cohort::algorithms
