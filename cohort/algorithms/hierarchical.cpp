#include "cohort/algorithms/hierarchical.h"

#include <unistd.h>

#include <algorithm>
#include <vector>

#include "cohort/core/store/prefix_store.h"

namespace cohort::algorithms {

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

std::string local_node_key(const std::string& configured) {
  return configured.empty() ? host_name() : configured;
}

Topology exchange_topology(Store& store, int rank, int size, const std::string& key,
                           Millis timeout) {
  store.set_string("topology/" + std::to_string(rank), key);
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back("topology/" + std::to_string(r));
  store.wait(keys, timeout);
  Topology t;
  std::vector<std::string> seen;
  for (auto& k : keys) {
    const auto node = store.get_string(k);
    auto it = std::find(seen.begin(), seen.end(), node);
    if (it == seen.end()) it = seen.insert(seen.end(), node);
    t.node_of.push_back(static_cast<int>(it - seen.begin()));
  }
  t.nodes = static_cast<int>(seen.size());
  return t;
}

Hierarchy::Hierarchy(Engine& engine, const std::shared_ptr<Store>& store, const Topology& topo,
                     Millis timeout) {
  const int me = engine.rank();
  const int my_node = topo.node_of[static_cast<size_t>(me)];
  std::vector<int> members, leaders;
  for (int r = 0; r < static_cast<int>(topo.node_of.size()); ++r) {
    if (topo.node_of[static_cast<size_t>(r)] == my_node) members.push_back(r);
    // The lowest rank of each node leads it.
    const int n = topo.node_of[static_cast<size_t>(r)];
    if (std::find_if(leaders.begin(), leaders.end(), [&](int l) {
          return topo.node_of[static_cast<size_t>(l)] == n;
        }) == leaders.end()) {
      leaders.push_back(r);
    }
  }
  auto node_store = std::make_shared<PrefixStore>("node" + std::to_string(my_node), store);
  node_ = engine.create_subgroup(members, node_store, timeout);
  if (members.front() == me) {
    leaders_ = engine.create_subgroup(leaders, std::make_shared<PrefixStore>("leaders", store),
                                      timeout);
  }
}

void Hierarchy::all_reduce(Link& link, at::Tensor& buf, ReduceOp op) {
  // Pipelined in chunks, so the three phases overlap: while the leaders
  // exchange chunk k over the slow link, the node reduces chunk k+1 and
  // broadcasts chunk k-1. Every member issues the node's operations in one
  // order (all reduces, then the broadcasts), as collectives require.
  const int64_t n = buf.numel();
  const int64_t per_chunk =
      std::max<int64_t>(kChunkBytes / static_cast<int64_t>(buf.element_size()), 1);
  const int64_t chunks = std::min<int64_t>((n + per_chunk - 1) / per_chunk, kMaxChunks);
  const auto spans = even_spans(n, static_cast<int>(std::max<int64_t>(chunks, 1)));
  std::vector<at::Tensor> parts;
  for (auto& s : spans) parts.push_back(buf.narrow(0, s.offset, s.count));
  const bool in_node = node_->size() > 1;
  const bool among_leaders = leaders_ && leaders_->size() > 1;
  std::vector<WorkPtr> reduced, exchanged, spread;
  if (in_node) {
    for (auto& part : parts) reduced.push_back(node_->reduce(part, 0, op));
  }
  for (size_t k = 0; k < parts.size(); ++k) {
    if (in_node && leaders_) link.wait(reduced[k], "reduce inside the node");
    // Among leaders, the engine's own all-reduce: on a slow inter-node link
    // it streams without the per-message rendezvous of point-to-point
    // transfers (bench/algorithms/netns.sh, Gloo: the point-to-point ring
    // reached ~60% of the link there).
    if (among_leaders) exchanged.push_back(leaders_->all_reduce(parts[k], op));
  }
  for (size_t k = 0; k < parts.size(); ++k) {
    if (among_leaders) link.wait(exchanged[k], "all_reduce among node leaders");
    if (in_node) spread.push_back(node_->broadcast(parts[k], 0));
  }
  for (auto& w : spread) link.wait(w, "broadcast inside the node");
  // Non-leaders' reduces finished before the broadcasts could (same order).
  if (in_node && !leaders_) {
    for (auto& w : reduced) link.wait(w, "reduce inside the node");
  }
}

}  // namespace cohort::algorithms
