// plan_of and agree_on_plan: every rank checks every rank's tensors and
// chunk boxes, as rank 0's merge would, before a save touches its folder.
#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "cohort/dcp/save_steps.h"

namespace cohort::dcp {
namespace {

// One rank's entry for a tensor in the plan.
struct Entry {
  std::string fqn;
  std::vector<int64_t> shape;
  std::string dtype;
  bool replicated = false;
  bool write = false;
  std::vector<Box> boxes;  // what this rank writes of it
};

Entry entry_of(const nlohmann::json& j) {
  Entry e{j.at(0).get<std::string>(), j.at(1).get<std::vector<int64_t>>(),
          j.at(2).get<std::string>(), j.at(3).get<bool>(),
          j.at(4).get<bool>(),        {}};
  for (const auto& b : j.at(5)) {
    e.boxes.push_back({b.at(0).get<std::vector<int64_t>>(), b.at(1).get<std::vector<int64_t>>()});
  }
  return e;
}

// A tensor as the ranks hold it: the lowest rank's entry, which every
// other's must match, and every rank's boxes.
struct Tensor {
  int first = 0;
  Entry entry;
  bool written = false;  // some rank writes it (a replicated one: the rank dealt it)
  std::vector<std::pair<int, Box>> boxes;
};

std::string as_held(int rank, const Entry& e) {
  return "rank " + std::to_string(rank) + " holds it as " + shape_string(e.shape) + " " + e.dtype +
         (e.replicated ? " replicated" : " not replicated");
}

// "rank 0 holds [0:3, 0:4]; rank 1 holds [3:6, 0:4], [0:1, 0:4]", the
// first kListed boxes.
std::string holdings(const Tensor& t) {
  constexpr size_t kListed = 8;
  std::string s;
  int last = -1;
  for (size_t i = 0; i < t.boxes.size() && i < kListed; ++i) {
    const auto& [rank, box] = t.boxes[i];
    s += rank == last
             ? ", "
             : std::string(s.empty() ? "" : "; ") + "rank " + std::to_string(rank) + " holds ";
    s += to_string(box);
    last = rank;
  }
  if (t.boxes.size() > kListed) s += ", ... (" + std::to_string(t.boxes.size()) + " boxes)";
  return s.empty() ? "no rank writes any of it" : s;
}

// The replicated tensors in each rank's order must be one list: each is
// written by the rank that list deals it to (replicated_writers).
void check_replicated(const std::vector<std::vector<std::string>>& lists,
                      const std::map<std::string, Tensor>& tensors, const std::string& op) {
  for (const auto& [fqn, t] : tensors) {
    if (!t.entry.replicated) continue;
    for (size_t r = 0; r < lists.size(); ++r) {
      if (std::find(lists[r].begin(), lists[r].end(), fqn) != lists[r].end()) continue;
      throw InvalidArgument(op + ": tensor " + fqn + ": rank " + std::to_string(t.first) +
                            " holds it replicated, rank " + std::to_string(r) +
                            " does not hold it: a replicated tensor is in every rank's state dict");
    }
  }
  auto joined = [](const std::vector<std::string>& v) {
    std::string s;
    for (const auto& n : v) s += (s.empty() ? "" : ", ") + n;
    return s;
  };
  for (size_t r = 1; r < lists.size(); ++r) {
    if (lists[r] == lists[0]) continue;
    throw InvalidArgument(
        op + ": ranks 0 and " + std::to_string(r) +
        " list the replicated tensors in different orders (rank 0: " + joined(lists[0]) +
        "; rank " + std::to_string(r) + ": " + joined(lists[r]) +
        "): each is written by the rank their order deals it to, so every "
        "rank's state dict lists them alike");
  }
}

void check_plans(const std::vector<std::string>& plans, const std::string& op) {
  std::map<std::string, Tensor> tensors;
  std::vector<std::vector<std::string>> replicated(plans.size());
  for (size_t r = 0; r < plans.size(); ++r) {
    const int rank = static_cast<int>(r);
    std::set<std::string> seen;
    for (const auto& j : nlohmann::json::parse(plans[r])) {
      auto e = entry_of(j);
      if (!seen.insert(e.fqn).second) {
        throw InvalidArgument(op + ": tensor " + e.fqn + ": rank " + std::to_string(rank) +
                              " lists it twice in its state dict");
      }
      if (e.replicated) replicated[r].push_back(e.fqn);
      auto [it, fresh] = tensors.try_emplace(e.fqn);
      auto& t = it->second;
      if (fresh) {
        t.first = rank;
        t.entry = e;
      } else if (t.entry.shape != e.shape || t.entry.dtype != e.dtype ||
                 t.entry.replicated != e.replicated) {
        throw InvalidArgument(op + ": tensor " + e.fqn + ": " + as_held(rank, e) + ", " +
                              as_held(t.first, t.entry) +
                              ": every rank must give a tensor one global shape, dtype and "
                              "layout");
      }
      // A replicated tensor that some rank would write: its dealt rank
      // must, or the checkpoint would lack it.
      t.written = t.written || !e.boxes.empty() || e.write;
      for (auto& b : e.boxes) t.boxes.emplace_back(rank, std::move(b));
    }
  }
  check_replicated(replicated, tensors, op);
  for (const auto& [fqn, t] : tensors) {
    if (!t.written) continue;
    TensorMeta meta;
    meta.fqn = fqn;
    meta.shape = t.entry.shape;
    for (const auto& [rank, box] : t.boxes) meta.chunks.push_back({box, rank, 0, {}});
    const auto error = tiling_error(meta);
    if (error.empty()) continue;
    throw InvalidArgument(op + ": tensor " + fqn + ": the ranks' shards do not tile its shape " +
                          shape_string(t.entry.shape) + ": " + error + " (" + holdings(t) + ")");
  }
}

}  // namespace

std::string plan_of(const StateDict& state, const StagedFile& staged) {
  nlohmann::json plan = nlohmann::json::array();
  size_t next = 0;  // staged.tensors holds the written tensors, in the state dict's order
  for (const auto& t : state.tensors) {
    nlohmann::json boxes = nlohmann::json::array();
    if (next < staged.tensors.size() && staged.tensors[next].at("fqn") == t.fqn) {
      for (const auto& c : staged.tensors[next++].at("chunks")) {
        boxes.push_back({c.at("offsets"), c.at("lengths")});
      }
    }
    plan.push_back({t.fqn, t.shape, dtype_name(t.dtype), t.replicated, t.write, boxes});
  }
  return plan.dump();
}

void agree_on_plan(Communicator& comm, const std::string& plan, const std::string& error,
                   ErrorKind kind, const std::string& op) {
  // One exchange carries each rank's error or, when it has none, its plan.
  const char kPlan = 'P';
  const auto all =
      all_gather_strings(comm, error.empty() ? kPlan + plan : static_cast<char>(kind) + error);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].at(0) != kPlan) throw_agreed(static_cast<int>(r), all[r]);
  }
  std::vector<std::string> plans;
  for (const auto& p : all) plans.push_back(p.substr(1));
  try {
    check_plans(plans, op);
  } catch (const nlohmann::json::exception& e) {
    throw Error(op + ": a rank's plan is not readable: " + std::string(e.what()));
  }
}

}  // namespace cohort::dcp
