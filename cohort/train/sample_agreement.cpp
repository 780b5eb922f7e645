#include "cohort/train/sample_agreement.h"

#include <algorithm>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort {
namespace {

// What a rank found: nothing, other samples or other inputs in one group.
enum Found : int64_t { kAgreed = 0, kOtherSamples = 1, kOtherInputs = 2 };

// A rank's words: its world rank, then the digests of its targets and its
// inputs. Only the first micro-batch, so the check costs one batch's hash
// per epoch, whatever the data.
enum Word { kRank = 0, kTargets = 1, kInputs = 2, kWords = 3 };

int64_t digest_of(const torch::Tensor& t) {
  const auto bytes = t.cpu().contiguous();
  return static_cast<int64_t>(
      content_digest(bytes.data_ptr(), static_cast<size_t>(bytes.numel() * bytes.element_size())));
}

std::string hex(int64_t word) {
  std::ostringstream os;
  os << std::hex << static_cast<uint64_t>(word);
  return os.str();
}

bool same(const RankWords& all, Word w) {
  for (int r = 1; r < all.ranks(); ++r) {
    if (all.of(r)[w] != all.of(0)[w]) return false;
  }
  return true;
}

// "ranks 0, 1" or "rank 3": world ranks, as flagged_ranks names them.
std::string ranks_text(const std::vector<int64_t>& ranks) {
  std::string out = ranks.size() > 1 ? "ranks " : "rank ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

// "rank 0: inputs 1f..; ranks 1, 2: inputs 9c..": the group's world ranks
// grouped by the digest `w`.
std::string by_digest(const RankWords& all, Word w, const std::string& what) {
  std::vector<std::pair<int64_t, std::vector<int64_t>>> groups;
  for (int r = 0; r < all.ranks(); ++r) {
    const int64_t d = all.of(r)[w];
    auto it =
        std::find_if(groups.begin(), groups.end(), [d](const auto& g) { return g.first == d; });
    if (it == groups.end()) it = groups.insert(groups.end(), {d, {}});
    it->second.push_back(all.of(r)[kRank]);
  }
  std::string out;
  for (size_t g = 0; g < groups.size(); ++g) {
    out +=
        (g ? "; " : "") + ranks_text(groups[g].second) + ": " + what + " " + hex(groups[g].first);
  }
  return out;
}

}  // namespace

void agree_on_samples(Communicator& world, const TrainerLayout& layout, DataSource& data,
                      int64_t epoch) {
  const auto groups = layout.same_samples_groups();
  if (groups.empty()) return;
  const auto inputs_groups = layout.same_inputs_groups();
  std::vector<int64_t> mine(kWords, 0);
  mine[kRank] = world.rank();
  if (data.num_batches() > 0) {
    // Targets, not inputs, in every group: across a pipeline only stage 0
    // reads the inputs, which may be augmented per rank.
    const auto first = data.batch(0);
    mine[kTargets] = digest_of(first.target.defined() ? first.target : first.data);
    mine[kInputs] = digest_of(first.data);
  }
  const std::string who = "Trainer::fit on rank " + std::to_string(world.rank()) + ": ";
  const std::string when = " of epoch " + std::to_string(epoch) + "'s first micro-batch";
  Found found = kAgreed;
  std::string error;
  for (const auto& group : groups) {
    if (group->size() == 1) continue;
    const RankWords all = gather_words(*group, mine);
    std::vector<int64_t> members;
    for (int r = 0; r < all.ranks(); ++r) members.push_back(all.of(r)[kRank]);
    const std::string ranks = ranks_text(members);
    if (found != kAgreed) continue;
    if (!same(all, kTargets)) {
      found = kOtherSamples;
      error = who + "the samples" + when + " differ within " + layout.describe() + " (" +
              by_digest(all, kTargets, "targets") + "), whose " + ranks +
              " must all draw the same samples; shard the data over the data-parallel group, "
              "not the world (a TensorDataSource's rank and size are the data-parallel rank "
              "and size)";
      continue;
    }
    const bool inputs =
        std::find(inputs_groups.begin(), inputs_groups.end(), group) != inputs_groups.end();
    if (inputs && !same(all, kInputs)) {
      found = kOtherInputs;
      error = who + "the inputs" + when + " differ within a tensor-parallel group (" +
              by_digest(all, kInputs, "inputs") + "; the targets agree), whose " + ranks +
              " must all see the same inputs: a column-parallel layer reads its whole input on "
              "each of them and the row-parallel sum would add products of different inputs. "
              "Augment alike within the group, e.g. seeded per data-parallel rank "
              "(data::manual_seed(seed, SeedScope::PerRank, the data-parallel group)), not per "
              "rank";
    }
  }
  // Each group's ranks learnt of their own group only: the world learns
  // which ranks refused, so that no rank goes on into the step's
  // collectives without them.
  if (world.size() == 1) {
    if (found != kAgreed) throw InvalidArgument(error);
    return;
  }
  const RankWords all = gather_words(world, {static_cast<int64_t>(found)});
  if (found != kAgreed) throw InvalidArgument(error);
  std::vector<char> samples(static_cast<size_t>(all.ranks())), inputs(samples);
  for (int r = 0; r < all.ranks(); ++r) {
    samples[static_cast<size_t>(r)] = all.of(r)[0] == kOtherSamples;
    inputs[static_cast<size_t>(r)] = all.of(r)[0] == kOtherInputs;
  }
  const std::string other_samples = flagged_ranks(samples), other_inputs = flagged_ranks(inputs);
  if (other_samples.empty() && other_inputs.empty()) return;
  std::string what;
  if (!other_samples.empty()) {
    what = other_samples + " found the samples" + when + " differ within " + layout.describe() +
           ", whose ranks must all draw the same samples (shard the data over the data-parallel "
           "group, not the world)";
  }
  if (!other_inputs.empty()) {
    what += (what.empty() ? "" : "; ") + other_inputs + " found the inputs" + when +
            " differ within their tensor-parallel group, whose ranks must all see the same inputs";
  }
  throw InvalidArgument(who + what + " (the error there names them), so no rank goes on");
}

}  // namespace cohort
