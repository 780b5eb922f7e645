// Subgroups: new_group and split. Each group gets its own key space in the
// parent's store ("g<n>" or "s<n>/c<color>"), where n counts the groups this
// communicator created: every rank creates groups in the same order, so n
// agrees across ranks without a message.
#include <algorithm>
#include <set>

#include "cohort/comm/communicator.h"
#include "cohort/comm/communicator_internal.h"
#include "cohort/comm/in_flight.h"
#include "cohort/core/error.h"
#include "cohort/core/store/prefix_store.h"

namespace cohort {
namespace {

// The members in order, hashed (FNV-1a, never 0): a signature's layout, so
// that ranks that list a group differently disagree before building it.
uint32_t ranks_hash(const std::vector<int>& ranks) {
  uint32_t h = 2166136261u;
  for (int r : ranks) {
    for (int b = 0; b < 4; ++b) {
      h ^= static_cast<uint32_t>(r >> (8 * b)) & 0xffu;
      h *= 16777619u;
    }
  }
  return h == 0 ? 1 : h;
}

}  // namespace

std::shared_ptr<Communicator> Communicator::make_subgroup(const std::vector<int>& ranks,
                                                          const std::string& key_space,
                                                          CommunicatorOptions options) {
  auto store = std::make_shared<PrefixStore>(key_space, store_);
  store->set_timeout(options.timeout);
  auto engine = engine_->create_subgroup(ranks, store, options.timeout);
  // A rank has one timeline: the group records on its parent's.
  const std::string trace_dir = tracer_ ? options.trace_dir : std::string();
  options.trace_dir.clear();
  auto group = std::make_shared<Communicator>(std::move(engine), std::move(store), options);
  group->tracer_ = tracer_;
  group->options_.trace_dir = trace_dir;
  return group;
}

std::shared_ptr<Communicator> Communicator::new_group(const std::vector<int>& ranks) {
  auto options = options_;
  options.name.clear();
  return new_group(ranks, std::move(options));
}

std::shared_ptr<Communicator> Communicator::new_group(const std::vector<int>& ranks,
                                                      CommunicatorOptions options) {
  const detail::Access nothing;
  auto call = begin_collective("new_group", kDefaultTimeout, nothing);
  std::set<int> seen;
  std::string listed;
  for (int r : ranks) {
    if (r < 0 || r >= size_ || !seen.insert(r).second) {
      call.refuse(
          "rank " + std::to_string(r) +
          (seen.count(r) && r >= 0 && r < size_ ? " is listed twice" : " is outside the group"));
    }
    listed += (listed.empty() ? "" : ", ") + std::to_string(r);
  }
  if (ranks.empty()) call.refuse("ranks is empty");
  debug_check(call, [&] { return "new_group([" + listed + "])"; });
  // Every rank must list the same members in the same order; otherwise the
  // subgroup's rendezvous would only time out. One engine barrier carries
  // the list's hash, and every rank learns of a difference.
  Signature sig;
  sig.count = static_cast<int64_t>(ranks.size());
  sig.layout = ranks_hash(ranks);
  sig.timeout = call.ctx.timeout;
  if (auto failed = detail::agree(*engine_, sig, call.ctx.timeout)) {
    // Its wait() names the call and marks the communicator failed, as after
    // any mismatched collective.
    Work work = finish(call, failed);
    try {
      work.wait();
    } catch (const MismatchError& e) {
      throw MismatchError(std::string(e.what()) +
                          " (the ranks listed different members, or the same in another order; "
                          "this rank listed [" +
                          listed + "])");
    }
  }
  const auto id = std::to_string(groups_created_++);
  if (!seen.count(rank_)) return nullptr;
  if (options.name.empty()) options.name = name() + "/g" + id;
  return make_subgroup(ranks, "g" + id, std::move(options));
}

std::shared_ptr<Communicator> Communicator::split(int color, int key) {
  // Everyone learns everyone's (color, key), then picks its own group.
  auto mine = torch::tensor({static_cast<int64_t>(color), static_cast<int64_t>(key)});
  std::vector<torch::Tensor> all(static_cast<size_t>(size_));
  for (auto& t : all) t = torch::empty({2}, torch::kLong);
  all_gather(all, mine).wait();
  const auto id = std::to_string(groups_created_++);
  if (color < 0) return nullptr;

  std::vector<std::pair<int64_t, int>> members;  // (key, rank)
  for (int r = 0; r < size_; ++r) {
    if (all[r][0].item<int64_t>() == color) members.emplace_back(all[r][1].item<int64_t>(), r);
  }
  std::sort(members.begin(), members.end());
  std::vector<int> ranks;
  for (auto& m : members) ranks.push_back(m.second);
  const auto c = std::to_string(color);
  auto options = options_;
  options.name = name() + "/split" + id + ":" + c;
  return make_subgroup(ranks, "s" + id + "/c" + c, std::move(options));
}

}  // namespace cohort
