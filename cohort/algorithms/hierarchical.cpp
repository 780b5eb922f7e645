#include "cohort/algorithms/hierarchical.h"

#include <unistd.h>

#include <algorithm>

#include "cohort/comm/env.h"
#include "cohort/comm/store/prefix_store.h"

namespace cohort::algorithms {

bool Topology::hierarchical() const {
  if (nodes < 2) return false;
  std::vector<int> count(static_cast<size_t>(nodes), 0);
  for (int n : node_of) ++count[static_cast<size_t>(n)];
  return *std::max_element(count.begin(), count.end()) > 1;
}

std::string local_node_key(const std::string& configured) {
  if (!configured.empty()) return configured;
  if (auto id = env::get("COHORT_NODE_ID")) return "id:" + *id;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  if (auto group = env::get("GROUP_RANK")) return std::string(host) + "/group:" + *group;
  return host;
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
  if (node_->size() > 1) link.wait(node_->reduce(buf, 0, op), "reduce inside the node");
  // Among leaders, the engine's own all-reduce: on a slow inter-node link
  // it streams without the per-message rendezvous of point-to-point
  // transfers (measured with bench/algorithms/netns.sh, Gloo: the
  // point-to-point ring reached ~60% of the link there).
  if (leaders_ && leaders_->size() > 1) {
    link.wait(leaders_->all_reduce(buf, op), "all_reduce among node leaders");
  }
  if (node_->size() > 1) link.wait(node_->broadcast(buf, 0), "broadcast inside the node");
}

}  // namespace cohort::algorithms
