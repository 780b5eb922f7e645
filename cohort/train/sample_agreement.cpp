#include "cohort/train/sample_agreement.h"

#include <algorithm>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/train/rng_state.h"

namespace cohort {
namespace {

// What a rank found in one group: nothing, other samples, other inputs, or
// a context-parallel group whose source names no samples.
enum Found : int64_t { kAgreed = 0, kOtherSamples = 1, kOtherInputs = 2, kNoIndices = 3 };

// A rank's words: its world rank, the digests of its targets, its inputs
// and its sample indices, and whether it has indices. Only the first
// micro-batch, so the check costs one batch's hash per epoch, whatever the
// data.
enum Word { kRank = 0, kTargets = 1, kInputs = 2, kIndices = 3, kIndexed = 4, kWords = 5 };

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

bool contains(const std::vector<std::shared_ptr<Communicator>>& groups,
              const std::shared_ptr<Communicator>& group) {
  return std::find(groups.begin(), groups.end(), group) != groups.end();
}

// Whether the group's ranks have distinct world ranks. Not when the world
// is no parent of the group: a Trainer per TP rank runs over its
// data-parallel group, and a TP group's ranks share their rank there.
bool world_names(const RankWords& all) {
  std::vector<int64_t> ranks;
  for (int r = 0; r < all.ranks(); ++r) ranks.push_back(all.of(r)[kRank]);
  std::sort(ranks.begin(), ranks.end());
  return std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end();
}

// Group rank r's name: its world rank, or its rank in the group.
int64_t name_of(const RankWords& all, int r) { return world_names(all) ? all.of(r)[kRank] : r; }

// "ranks 0, 1" or "rank 3": world ranks, as flagged_ranks names them (or
// ranks in the group, "ranks 0, 1 of the group").
std::string ranks_text(const std::vector<int64_t>& ranks, bool world = true) {
  std::string out = ranks.size() > 1 ? "ranks " : "rank ";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return world ? out : out + " of the group";
}

// "rank 0: inputs 1f..; ranks 1, 2: inputs 9c..": the group's ranks
// grouped by the digest `w`.
std::string by_digest(const RankWords& all, Word w, const std::string& what) {
  std::vector<std::pair<int64_t, std::vector<int64_t>>> groups;
  for (int r = 0; r < all.ranks(); ++r) {
    const int64_t d = all.of(r)[w];
    auto it =
        std::find_if(groups.begin(), groups.end(), [d](const auto& g) { return g.first == d; });
    if (it == groups.end()) it = groups.insert(groups.end(), {d, {}});
    it->second.push_back(name_of(all, r));
  }
  std::string out;
  for (size_t g = 0; g < groups.size(); ++g) {
    out += (g ? "; " : "") + ranks_text(groups[g].second, world_names(all)) + ": " + what + " " +
           hex(groups[g].first);
  }
  return out;
}

// The ranks of `all` that give no sample indices.
std::vector<int64_t> unindexed(const RankWords& all) {
  std::vector<int64_t> out;
  for (int r = 0; r < all.ranks(); ++r) {
    if (!all.of(r)[kIndexed]) out.push_back(all.of(r)[kRank]);
  }
  return out;
}

// What one group's words show, with the message for its ranks.
struct Finding {
  Found found = kAgreed;
  std::string error;
};

// How each message names the group and the call.
struct Names {
  std::string who;     // "Trainer::fit on rank 2: "
  std::string when;    // " of epoch 1's first micro-batch"
  std::string ranks;   // the group's world ranks
  std::string layout;  // TrainerLayout::describe()
};

const char* const kShard =
    "shard the data over the data-parallel group, not the world (a TensorDataSource's rank and "
    "size are the data-parallel rank and size)";

// A context-parallel group: each rank holds other positions of the same
// sequences, so the contents differ by design and the sample indices must
// not.
Finding in_split_group(const RankWords& all, const Names& n) {
  const auto missing = unindexed(all);
  if (!missing.empty()) {
    return {kNoIndices, n.who + "the data source on " + ranks_text(missing) +
                            " gives no sample indices (DataSource::sample_indices), which fit() "
                            "needs under context parallelism: the " +
                            n.ranks +
                            " of a context-parallel group each hold other positions of the same "
                            "sequences, so only the samples' indices tell whether they drew the "
                            "same ones (TensorDataSource and SampledDataSource give them)"};
  }
  if (same(all, kIndices)) return {};
  return {kOtherSamples, n.who + "the samples" + n.when +
                             " differ within a context-parallel group (" +
                             by_digest(all, kIndices, "indices") + "), whose " + n.ranks +
                             " must all draw the same samples, each holding other positions of "
                             "them (ring attention would join parts of different sequences); " +
                             kShard};
}

// A pipeline's or a TP group (`inputs`: its ranks read the same inputs).
Finding in_group(const RankWords& all, const Names& n, bool inputs) {
  if (!same(all, kTargets)) {
    return {kOtherSamples, n.who + "the samples" + n.when + " differ within " + n.layout + " (" +
                               by_digest(all, kTargets, "targets") + "), whose " + n.ranks +
                               " must all draw the same samples; " + kShard};
  }
  // Targets may agree by chance (few classes, small micro-batches).
  if (unindexed(all).empty() && !same(all, kIndices)) {
    return {kOtherSamples, n.who + "the samples" + n.when + " differ within " + n.layout + " (" +
                               by_digest(all, kIndices, "indices") +
                               "; the targets agree), whose " + n.ranks +
                               " must all draw the same samples; " + kShard};
  }
  if (!inputs || same(all, kInputs)) return {};
  return {kOtherInputs,
          n.who + "the inputs" + n.when + " differ within a tensor-parallel group (" +
              by_digest(all, kInputs, "inputs") + "; the targets agree), whose " + n.ranks +
              " must all see the same inputs: a column-parallel layer reads its whole input on "
              "each of them and the row-parallel sum would add products of different inputs. "
              "Augment alike within the group, e.g. seeded per data-parallel rank "
              "(data::manual_seed(seed, SeedScope::PerRank, the data-parallel group)), not per "
              "rank"};
}

// This rank's words: its first micro-batch's digests.
std::vector<int64_t> words_of(const Communicator& world, DataSource& data) {
  std::vector<int64_t> mine(kWords, 0);
  mine[kRank] = world.rank();
  // An epoch without micro-batches (on every rank: fit() agreed on their
  // number) has nothing to name.
  mine[kIndexed] = 1;
  if (data.num_batches() == 0) return mine;
  // Read outside the training order, at every epoch's start and once more
  // on resume: its draws from the default generators (augmentation) are
  // undone, so that the steps draw the same numbers either way.
  DefaultRngStatesKept kept;
  // Targets, not inputs, in every group: across a pipeline only stage 0
  // reads the inputs, which may be augmented per rank.
  const auto first = data.batch(0);
  mine[kTargets] = digest_of(first.target.defined() ? first.target : first.data);
  mine[kInputs] = digest_of(first.data);
  const auto indices = data.sample_indices(0);
  mine[kIndexed] = indices.defined();
  if (indices.defined()) mine[kIndices] = digest_of(indices.to(torch::kInt64));
  return mine;
}

// Each group's ranks learnt of their own group only: the world learns
// which ranks refused, so that no rank goes on into the step's collectives
// without them. Collective over `world` (none at size 1).
void refuse_together(Communicator& world, const Finding& finding, const Names& names) {
  if (world.size() == 1) {
    if (finding.found != kAgreed) throw InvalidArgument(finding.error);
    return;
  }
  const RankWords all = gather_words(world, {static_cast<int64_t>(finding.found)});
  if (finding.found != kAgreed) throw InvalidArgument(finding.error);
  std::vector<char> samples(static_cast<size_t>(all.ranks())), inputs(samples), unnamed(samples);
  for (int r = 0; r < all.ranks(); ++r) {
    samples[static_cast<size_t>(r)] = all.of(r)[0] == kOtherSamples;
    inputs[static_cast<size_t>(r)] = all.of(r)[0] == kOtherInputs;
    unnamed[static_cast<size_t>(r)] = all.of(r)[0] == kNoIndices;
  }
  const std::string other_samples = flagged_ranks(samples), other_inputs = flagged_ranks(inputs),
                    no_indices = flagged_ranks(unnamed);
  if (other_samples.empty() && other_inputs.empty() && no_indices.empty()) return;
  std::string what;
  if (!other_samples.empty()) {
    // The layout names the kind of group where it has one kind (a
    // tensor-parallel group); a pipeline's groups are of several kinds.
    const std::string kind = names.layout.empty() ? "" : " (" + names.layout + ")";
    what = other_samples + " found the samples" + names.when +
           " differ within a group whose ranks must all draw the same samples" + kind +
           " (shard the data over the data-parallel group, not the world)";
  }
  if (!other_inputs.empty()) {
    what += (what.empty() ? "" : "; ") + other_inputs + " found the inputs" + names.when +
            " differ within their tensor-parallel group, whose ranks must all see the same inputs";
  }
  if (!no_indices.empty()) {
    what += (what.empty() ? "" : "; ") + no_indices +
            " found a data source that gives no sample indices in their context-parallel group "
            "(DataSource::sample_indices)";
  }
  throw InvalidArgument(names.who + what + " (the error there names them), so no rank goes on");
}

}  // namespace

void agree_on_samples(Communicator& world, const TrainerLayout& layout, DataSource& data,
                      int64_t epoch) {
  const auto groups = layout.same_samples_groups();
  // Groups of one rank (a pipeline of one stage) have nothing to compare.
  if (std::all_of(groups.begin(), groups.end(), [](const auto& g) { return g->size() == 1; })) {
    return;
  }
  const auto inputs_groups = layout.same_inputs_groups();
  const auto split_groups = layout.sequence_split_groups();
  const auto mine = words_of(world, data);
  Names names{"Trainer::fit on rank " + std::to_string(world.rank()) + ": ",
              " of epoch " + std::to_string(epoch) + "'s first micro-batch", "", layout.describe()};
  Finding finding;
  for (const auto& group : groups) {
    if (group->size() == 1) continue;
    const RankWords all = gather_words(*group, mine);
    if (finding.found != kAgreed) continue;
    std::vector<int64_t> members;
    for (int r = 0; r < all.ranks(); ++r) members.push_back(name_of(all, r));
    names.ranks = ranks_text(members, world_names(all));
    finding = contains(split_groups, group) ? in_split_group(all, names)
                                            : in_group(all, names, contains(inputs_groups, group));
  }
  refuse_together(world, finding, names);
}

std::vector<int64_t> order_words(const std::string& order) {
  return {order.empty() ? 0 : 1, static_cast<int64_t>(fnv1a(order))};
}

std::optional<uint64_t> check_data_order(Communicator& world, const RankWords& all, size_t at,
                                         const std::string& order, const std::string& who) {
  std::set<int64_t> said;
  for (int r = 0; r < all.ranks(); ++r) {
    if (all.of(r)[at]) said.insert(all.of(r)[at + 1]);
  }
  if (said.empty()) return std::nullopt;
  if (said.size() == 1) return static_cast<uint64_t>(*said.begin());
  std::vector<std::string> orders = gather_texts(world, order);
  for (auto& o : orders) o = o.empty() ? "not said" : o;
  throw InvalidArgument(who +
                        "ranks disagree on the order their data sources deal the samples in "
                        "(DataSource::order_settings: " +
                        name_groups(orders) +
                        "): replicas dealing from different orders train on some samples twice "
                        "and others never; deal by the same settings on every rank");
}

void check_data_shards(const std::vector<DataShard>& shards, int copies, const std::string& who) {
  const int world = static_cast<int>(shards.size());
  // Datasets of other sizes have other orders (another permutation, other
  // padding), whatever the shares.
  std::vector<std::string> sizes;
  std::set<int64_t> said;
  for (const auto& s : shards) {
    sizes.push_back(s.samples >= 0 ? std::to_string(s.samples) + " samples" : "not said");
    if (s.samples >= 0) said.insert(s.samples);
  }
  if (said.size() > 1) {
    throw InvalidArgument(who + "the data sources deal from datasets of different sizes (" +
                          name_groups(sizes) +
                          "), in different orders: the replicas would train on some samples "
                          "twice and others never; give every rank the same dataset");
  }
  for (const auto& s : shards) {
    if (s.world <= 0) return;
  }
  const int replicas = copies > 0 ? world / copies : world;
  std::vector<int> dealt(static_cast<size_t>(replicas), 0);
  bool fits = world % std::max(copies, 1) == 0;
  for (const auto& s : shards) {
    fits = fits && s.world == replicas && s.rank >= 0 && s.rank < replicas;
    if (fits) ++dealt[static_cast<size_t>(s.rank)];
  }
  for (const int n : dealt) fits = fits && n == copies;
  if (fits) return;
  std::vector<std::string> values;
  for (const auto& s : shards) {
    values.push_back("share " + std::to_string(s.rank) + " of " + std::to_string(s.world));
  }
  throw InvalidArgument(
      who + "the data sources deal " + name_groups(values) + ", but the " +
      std::to_string(replicas) + " data-parallel replicas (" + std::to_string(world) + " ranks, " +
      std::to_string(copies) + " per sample) need each share of " + std::to_string(replicas) +
      " once" + (copies > 1 ? " per rank of a replica" : "") +
      ": replicas would train on the same samples; make each source with its data-parallel "
      "rank and size");
}

}  // namespace cohort
