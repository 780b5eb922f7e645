#include "cohort/data/distributed_sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort::data {
namespace {

DistributedSamplerOptions with_defaults(DistributedSamplerOptions o, const Communicator& comm) {
  if (!o.num_replicas) o.num_replicas = comm.size();
  if (!o.rank) o.rank = comm.rank();
  return o;
}

int checked_replicas(const DistributedSamplerOptions& o) {
  if (!o.num_replicas || !o.rank) {
    throw InvalidArgument(
        "DistributedSampler: set num_replicas and rank, or pass a Communicator to take them from");
  }
  if (*o.num_replicas < 1 || *o.rank < 0 || *o.rank >= *o.num_replicas) {
    throw InvalidArgument("DistributedSampler: rank " + std::to_string(*o.rank) +
                          " is out of range for num_replicas " + std::to_string(*o.num_replicas));
  }
  return *o.num_replicas;
}

// One rank's words in the agreement, in this order. kGroup: the rank's
// place in its data-parallel group, -1 when built without one.
enum Word { kSize, kReplicas, kRank, kSeed, kShuffle, kDropLast, kGroup, kWords };

// "ranks 0, 1" or "rank 3"; "a, b" after `one`/`many` by the count.
std::string list_text(const char* one, const char* many, const std::vector<int64_t>& items) {
  std::string out = items.size() > 1 ? many : one;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : " ") + std::to_string(items[i]);
  return out;
}

// With a data-parallel group on every rank: what is wrong with the ranks'
// replicas, "" when nothing is. The ranks at one data-parallel rank (a
// mesh's tensor-parallel, pipeline, context-parallel peers) must share one
// replica, and the ranks at different ones must take different replicas.
std::string grouping_fault(const RankWords& all) {
  struct Place {
    std::vector<int64_t> ranks;
    std::set<int64_t> replicas;
  };
  std::map<int64_t, Place> at;                    // data-parallel rank -> its ranks
  std::map<int64_t, std::set<int64_t>> asked_at;  // replica -> data-parallel ranks
  for (int r = 0; r < all.ranks(); ++r) {
    const int64_t place = all.of(r)[kGroup], replica = all.of(r)[kRank];
    at[place].ranks.push_back(r);
    at[place].replicas.insert(replica);
    asked_at[replica].insert(place);
  }
  constexpr size_t kShown = 4;  // clauses named; the rest counted
  std::vector<std::string> clauses;
  for (const auto& [place, p] : at) {
    if (p.replicas.size() < 2) continue;
    clauses.push_back("data-parallel rank " + std::to_string(place) + " (" +
                      list_text("rank", "ranks", p.ranks) + ") asks for " +
                      list_text("replica", "replicas", {p.replicas.begin(), p.replicas.end()}));
  }
  for (const auto& [replica, places] : asked_at) {
    if (places.size() < 2) continue;
    clauses.push_back(
        "replica " + std::to_string(replica) + " is asked for at " +
        list_text("data-parallel rank", "data-parallel ranks", {places.begin(), places.end()}));
  }
  if (clauses.empty()) return "";
  std::string text;
  for (size_t i = 0; i < clauses.size() && i < kShown; ++i) text += (i ? "; " : "") + clauses[i];
  if (clauses.size() > kShown) text += "; ... (" + std::to_string(clauses.size()) + " in all)";
  return "the ranks that share a data-parallel rank must take one replica and the others other "
         "replicas, but " +
         text +
         ": ranks that must see the same samples (tensor-parallel, pipeline or context-parallel "
         "peers) would train on different ones (leave rank and num_replicas unset to take the "
         "data-parallel group's)";
}

// "replica 2", "replicas 2, 3": the first few of `replicas`, and how many
// there are when that is not all of them.
std::string replicas_text(const std::vector<int64_t>& replicas, int64_t count) {
  std::string out = count > 1 ? "replicas " : "replica ";
  for (size_t i = 0; i < replicas.size(); ++i) out += (i ? ", " : "") + std::to_string(replicas[i]);
  if (count > static_cast<int64_t>(replicas.size())) out += ", ... (" + std::to_string(count) + ")";
  return out;
}

// What is wrong with every rank's settings together, on every rank alike;
// "" when nothing is.
std::string disagreement(const RankWords& all, int comm_size) {
  // The order every rank deals from: ranks apart deal their shares of
  // different orders.
  std::vector<std::string> clauses;
  auto field = [&](const char* name, const std::function<std::string(int64_t)>& text, int word) {
    const auto values = all.values([&](const int64_t* w) { return text(w[word]); });
    if (!all_same(values)) clauses.push_back(std::string(name) + " (" + name_groups(values) + ")");
  };
  auto number = [](int64_t v) { return std::to_string(v); };
  auto flag = [](int64_t v) { return std::string(v ? "true" : "false"); };
  auto unsigned_number = [](int64_t v) { return std::to_string(static_cast<uint64_t>(v)); };
  field("dataset_size", number, kSize);
  field("seed", unsigned_number, kSeed);
  field("shuffle", flag, kShuffle);
  field("drop_last", flag, kDropLast);
  field("num_replicas", number, kReplicas);
  field(
      "data-parallel group", [](int64_t v) { return std::string(v >= 0 ? "given" : "none"); },
      kGroup);
  if (!clauses.empty()) {
    std::string text = "the ranks disagree on ";
    for (size_t i = 0; i < clauses.size(); ++i) text += (i ? ", " : "") + clauses[i];
    return text +
           "; the ranks would deal their shares of different orders, so that some samples are "
           "trained on twice and others never (pass the same on every rank)";
  }

  // Each rank's own range, which its constructor would check alone.
  const int64_t replicas = all.of(0)[kReplicas];
  std::string range;
  for (int r = 0; r < all.ranks(); ++r) {
    const int64_t rank = all.of(r)[kRank];
    if (replicas >= 1 && rank >= 0 && rank < replicas) continue;
    range += std::string(range.empty() ? "" : "; ") + "rank " + std::to_string(r) +
             " asks for rank " + std::to_string(rank) + ", out of range for num_replicas " +
             std::to_string(replicas);
  }
  if (!range.empty()) return range;
  if (all.of(0)[kGroup] >= 0) {
    const auto grouping = grouping_fault(all);
    if (!grouping.empty()) return grouping;
  }

  // Every replica taken by as many ranks as every other (once each over a
  // communicator of num_replicas ranks; by a whole tensor-parallel group
  // each when such groups share their data).
  std::map<int64_t, int> takers;  // replica -> ranks that take it
  for (int r = 0; r < all.ranks(); ++r) ++takers[all.of(r)[kRank]];
  const bool even = static_cast<int64_t>(takers.size()) == replicas &&
                    std::all_of(takers.begin(), takers.end(),
                                [&](const auto& t) { return t.second == takers.begin()->second; });
  if (even) return "";
  std::vector<int64_t> untaken;  // the first few
  for (int64_t i = 0; i < replicas && untaken.size() < 8; ++i) {
    if (!takers.count(i)) untaken.push_back(i);
  }
  const int64_t untaken_count = replicas - static_cast<int64_t>(takers.size());
  const auto ranks = all.values([](const int64_t* w) { return std::to_string(w[kRank]); });
  return "the " + std::to_string(comm_size) + " rank(s) do not take num_replicas " +
         std::to_string(replicas) + "'s replicas evenly: rank (" + name_groups(ranks) + ")" +
         (untaken.empty() ? "" : ", no rank takes " + replicas_text(untaken, untaken_count)) +
         "; some samples would be trained on more often than others, or never (leave rank unset "
         "to take the communicator's)";
}

// The options with the defaults of `replicas` (the data-parallel group, or
// `comm` itself), once every rank's agree. Collective over `comm`: every
// rank gathers every rank's settings and finds the same fault, so that all
// refuse together instead of one rank throwing while the others wait for it
// in their next collective.
DistributedSamplerOptions agreed(size_t dataset_size, DistributedSamplerOptions o,
                                 Communicator& comm, const Communicator* replicas) {
  o = with_defaults(o, replicas ? *replicas : comm);
  std::vector<int64_t> mine(kWords);
  mine[kSize] = static_cast<int64_t>(dataset_size);
  mine[kReplicas] = *o.num_replicas;
  mine[kRank] = *o.rank;
  mine[kSeed] = static_cast<int64_t>(o.seed);
  mine[kShuffle] = o.shuffle;
  mine[kDropLast] = o.drop_last;
  mine[kGroup] = replicas ? replicas->rank() : -1;
  const RankWords all = comm.size() > 1 ? gather_words(comm, mine) : RankWords(mine, 1);
  const std::string fault = disagreement(all, comm.size());
  if (!fault.empty()) {
    throw InvalidArgument("DistributedSampler on rank " + std::to_string(comm.rank()) + " of " +
                          std::to_string(comm.size()) + ": " + fault);
  }
  return o;
}

}  // namespace

DistributedSampler::DistributedSampler(size_t dataset_size, Communicator& comm,
                                       DistributedSamplerOptions options)
    : DistributedSampler(dataset_size, agreed(dataset_size, options, comm, nullptr)) {}

DistributedSampler::DistributedSampler(size_t dataset_size, Communicator& comm,
                                       const Communicator& data_parallel,
                                       DistributedSamplerOptions options)
    : DistributedSampler(dataset_size, agreed(dataset_size, options, comm, &data_parallel)) {}

DistributedSampler::DistributedSampler(size_t dataset_size, DistributedSamplerOptions options)
    : size_(dataset_size),
      num_replicas_(checked_replicas(options)),
      rank_(*options.rank),
      shuffle_(options.shuffle),
      seed_(options.seed),
      drop_last_(options.drop_last),
      epoch_(std::make_shared<std::atomic<int64_t>>(0)) {
  reset();
}

void DistributedSampler::set_epoch(int64_t epoch) { epoch_->store(epoch); }

int64_t DistributedSampler::epoch() const { return epoch_->load(); }

size_t DistributedSampler::num_samples() const {
  // PyTorch: ceil((n - R) / R) with drop_last when R does not divide n,
  // which is floor(n / R); ceil(n / R) otherwise.
  const auto r = static_cast<size_t>(num_replicas_);
  return drop_last_ ? size_ / r : (size_ + r - 1) / r;
}

size_t DistributedSampler::total_size() const {
  return num_samples() * static_cast<size_t>(num_replicas_);
}

std::vector<size_t> DistributedSampler::indices() const {
  std::vector<size_t> order(size_);
  if (shuffle_) {
    // The generator and call of PyTorch's sampler (g.manual_seed(seed +
    // epoch); torch.randperm(n, generator=g)): the same permutation.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ + static_cast<uint64_t>(epoch()));
    const auto perm = torch::randperm(static_cast<int64_t>(size_), gen, torch::kLong);
    const auto* p = perm.data_ptr<int64_t>();
    for (size_t i = 0; i < size_; ++i) order[i] = static_cast<size_t>(p[i]);
  } else {
    for (size_t i = 0; i < size_; ++i) order[i] = i;
  }
  // Padded by repeating the order from its start (as often as it takes),
  // or cut; then every num_replicas-th element from this rank's.
  const size_t total = total_size();
  std::vector<size_t> mine;
  mine.reserve(num_samples());
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(num_replicas_)) {
    mine.push_back(order[i % size_]);
  }
  return mine;
}

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  if (new_size) size_ = *new_size;
  indices_ = indices();
  next_ = 0;
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (next_ >= indices_.size()) return c10::nullopt;
  const size_t end = std::min(indices_.size(), next_ + batch_size);
  std::vector<size_t> batch(indices_.begin() + static_cast<std::ptrdiff_t>(next_),
                            indices_.begin() + static_cast<std::ptrdiff_t>(end));
  next_ = end;
  return batch;
}

// What decides the order: a position saved under other settings names
// other samples, so load() refuses it rather than skip or repeat some.
std::vector<std::pair<std::string, int64_t>> DistributedSampler::settings() const {
  return {{"dataset_size", static_cast<int64_t>(size_)},
          {"num_replicas", num_replicas_},
          {"seed", static_cast<int64_t>(seed_)},
          {"shuffle", shuffle_},
          {"drop_last", drop_last_}};
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", torch::tensor(epoch(), torch::kLong), /*is_buffer=*/true);
  archive.write("next", torch::tensor(static_cast<int64_t>(next_), torch::kLong),
                /*is_buffer=*/true);
  for (const auto& [name, value] : settings()) {
    archive.write(name, torch::tensor(value, torch::kLong), /*is_buffer=*/true);
  }
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  torch::Tensor epoch, next;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("next", next, /*is_buffer=*/true);
  for (const auto& [name, value] : settings()) {
    torch::Tensor saved;
    // (An archive of an earlier cohort has none of them.)
    if (!archive.try_read(name, saved, /*is_buffer=*/true)) continue;
    if (saved.item<int64_t>() != value) {
      throw InvalidArgument("DistributedSampler::load on rank " + std::to_string(rank_) +
                            ": the position was saved with " + name + " " +
                            std::to_string(saved.item<int64_t>()) + ", this sampler has " +
                            std::to_string(value) + "; the same position would name other samples");
    }
  }
  set_epoch(epoch.item<int64_t>());
  reset();
  const auto at = next.item<int64_t>();
  if (at < 0 || static_cast<size_t>(at) > indices_.size()) {
    throw InvalidArgument("DistributedSampler::load: position " + std::to_string(at) +
                          " is outside this rank's " + std::to_string(indices_.size()) +
                          " samples");
  }
  next_ = static_cast<size_t>(at);
}

}  // namespace cohort::data
