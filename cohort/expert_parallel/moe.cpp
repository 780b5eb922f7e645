#include "cohort/expert_parallel/moe.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/core/rank_local.h"
#include "cohort/expert_parallel/all_to_all.h"
#include "cohort/expert_parallel/input_agreement.h"
#include "cohort/grad_sync/average_gradients.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/mappings.h"

namespace cohort::expert_parallel {

namespace {

std::string where(const MoEOptions& o) {
  if (!o.ep_group) return "cohort: MoE";
  const auto& g = *o.ep_group;
  return "cohort: MoE (rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size()) +
         ", group " + g.name() + ")";
}

int tp_size(const MoEOptions& o) { return o.tp_group ? o.tp_group->size() : 1; }

void check_options(const MoEOptions& o, int ep) {
  auto bad = [&](const std::string& why) { throw InvalidArgument(where(o) + ": " + why); };
  if (o.hidden <= 0 || o.ffn <= 0 || o.experts <= 0) {
    bad("hidden, ffn and experts must be positive (got " + std::to_string(o.hidden) + ", " +
        std::to_string(o.ffn) + ", " + std::to_string(o.experts) + ")");
  }
  if (o.top_k != 1 && o.top_k != 2) bad("top_k must be 1 or 2, got " + std::to_string(o.top_k));
  if (o.top_k > o.experts) bad("top_k " + std::to_string(o.top_k) + " exceeds the experts");
  if (!(o.capacity_factor > 0) || !std::isfinite(o.capacity_factor))
    bad("capacity_factor must be positive, got " + std::to_string(o.capacity_factor));
  if (o.experts % ep != 0) {
    bad(std::to_string(o.experts) + " experts do not divide by the expert-parallel size " +
        std::to_string(ep));
  }
  if (o.ffn % tp_size(o) != 0) {
    bad("ffn " + std::to_string(o.ffn) + " does not divide by the tensor-parallel size " +
        std::to_string(tp_size(o)));
  }
}

// Draws the full (ep = 1, tp = 1) weights in a fixed order and keeps
// experts [first, first + local) and, of each, this tp rank's F / tp slice.
std::vector<torch::Tensor> master_weights(const MoEOptions& o, uint64_t seed, int64_t first,
                                          int64_t local) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto uniform = [&](at::IntArrayRef sizes, int64_t fan_in) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    return torch::empty(sizes).uniform_(-bound, bound, gen);
  };
  const int64_t e = o.experts, h = o.hidden, f = o.ffn;
  std::vector<torch::Tensor> w = {uniform({e, h}, h), uniform({e, f, h}, h), uniform({e, f}, h),
                                  uniform({e, h, f}, f), uniform({e, h}, f)};
  for (size_t i = 1; i < w.size(); ++i) w[i] = w[i].narrow(0, first, local);
  const int tp = tp_size(o);
  if (tp > 1) {
    const int64_t part = f / tp, at = o.tp_group->rank() * part;
    w[1] = w[1].narrow(1, at, part);
    w[2] = w[2].narrow(1, at, part);
    w[3] = w[3].narrow(2, at, part);
  }
  for (size_t i = 1; i < w.size(); ++i) w[i] = w[i].clone();
  return w;
}

// Indices that reorder rows received from each rank s, grouped by local
// expert j (src-major, counts[s][j]), into expert-major order.
torch::Tensor expert_major(const torch::Tensor& counts_on_device) {
  const auto counts = counts_on_device.cpu();
  const int64_t ranks = counts.size(0), local = counts.size(1);
  auto c = counts.accessor<int64_t, 2>();
  std::vector<int64_t> offset(static_cast<size_t>(ranks * local));
  int64_t at = 0;
  for (int64_t i = 0; i < ranks * local; ++i) {
    offset[static_cast<size_t>(i)] = at;
    at += c[i / local][i % local];
  }
  std::vector<torch::Tensor> parts;
  for (int64_t j = 0; j < local; ++j) {
    for (int64_t s = 0; s < ranks; ++s) {
      const auto begin = offset[static_cast<size_t>(s * local + j)];
      parts.push_back(torch::arange(begin, begin + c[s][j], torch::kInt64));
    }
  }
  return torch::cat(parts).to(counts_on_device.device());
}

std::vector<int64_t> to_vector(const torch::Tensor& t) {
  auto c = t.cpu().contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

// The options with the mesh's "ep" and "tp" groups (MoEImpl's mesh form).
MoEOptions with_mesh_groups(const DeviceMesh& mesh, MoEOptions options) {
  if (options.ep_group || options.tp_group || options.sequence_group) {
    const auto& group = mesh.process_group();
    throw InvalidArgument(
        "MoE (rank " + std::to_string(group->rank()) + " of " + std::to_string(group->size()) +
        "): the groups come from the mesh or from ep_group/tp_group/sequence_group, not "
        "both");
  }
  const auto names = mesh.dim_names();
  const auto has = [&](const char* name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  if (has("ep")) options.ep_group = mesh["ep"].process_group();
  if (has("tp")) options.tp_group = mesh["tp"].process_group();
  if (has("cp")) options.sequence_group = mesh["cp"].process_group();
  return options;
}

// The groups of the mesh's dimensions that hold replicas of one layer:
// every one but "ep", "tp" and "cp" (the layer's own groups) and "pp"
// (stages build different layers), of more than one rank.
std::vector<std::shared_ptr<Communicator>> replica_groups(const DeviceMesh& mesh) {
  std::vector<std::shared_ptr<Communicator>> out;
  for (const auto& name : mesh.dim_names()) {
    if (name == "ep" || name == "tp" || name == "cp" || name == "pp" || mesh.size(name) == 1) {
      continue;
    }
    out.push_back(mesh[name].process_group());
  }
  return out;
}

}  // namespace

MoEImpl::MoEImpl(const DeviceMesh& mesh, MoEOptions options)
    : MoEImpl(with_mesh_groups(mesh, std::move(options)), replica_groups(mesh)) {}

MoEImpl::MoEImpl(MoEOptions options) : MoEImpl(std::move(options), {}) {}

MoEImpl::MoEImpl(MoEOptions options, std::vector<std::shared_ptr<Communicator>> replicas)
    : options_(std::move(options)), replicas_(std::move(replicas)) {
  const int ep = options_.ep_group ? options_.ep_group->size() : 1;
  // Agreement first, so that ranks with different options all reach the
  // all-gather and all throw, instead of some throwing and some waiting;
  // it covers whether the seed is set, so all draw or none does.
  agree();
  check_options(options_, ep);
  if (options_.seed) {
    seed_ = *options_.seed;
  } else {
    // Over one mesh's groups, the smallest over ep, then tp, then cp (then
    // the replicas') is the smallest of the whole block; compared again
    // after, for groups that are not one mesh's.
    seed_ = tensor_parallel::draw_seed();
    for (const auto& g : {options_.ep_group, options_.tp_group, options_.sequence_group}) {
      if (g) seed_ = tensor_parallel::smallest_over(seed_, *g);
    }
    for (const auto& g : replicas_) seed_ = tensor_parallel::smallest_over(seed_, *g);
    drawn_ = true;
    agree();
  }
  local_ = options_.experts / ep;
  first_ = (options_.ep_group ? options_.ep_group->rank() : 0) * local_;
  auto w = master_weights(options_, seed_, first_, local_);
  router = register_parameter("router", w[0]);
  w1 = register_parameter("w1", w[1]);
  b1 = register_parameter("b1", w[2]);
  w2 = register_parameter("w2", w[3]);
  b2 = register_parameter("b2", w[4]);
  mark_split_parameters();
}

void MoEImpl::mark_split_parameters() const {
  const int ep = options_.ep_group ? options_.ep_group->size() : 1, tp = tp_size(options_);
  if (ep == 1 && tp == 1) return;
  std::string part_of = "an MoE's experts (this rank holds experts " + std::to_string(first_) +
                        " to " + std::to_string(first_ + local_ - 1) + " of " +
                        std::to_string(options_.experts);
  if (ep > 1) {
    part_of += ", split over the expert-parallel group " + options_.ep_group->name() + " of " +
               std::to_string(ep) + " ranks";
  }
  if (tp > 1) {
    part_of += ", each expert's FFN split over the tensor-parallel group " +
               options_.tp_group->name() + " of " + std::to_string(tp) + " ranks";
  }
  part_of += ")";
  const std::string remedy =
      "train it with TrainerWiring::mesh (GradientSynchronizerOptions::expert_parameters) or "
      "expert_parallel::average_moe_gradients, and checkpoint it with dcp::StateDictOptions::mesh";
  // b2 is whole on every TP rank: it differs across ranks only over ep.
  for (const auto* t : {&w1, &b1, &w2}) mark_rank_local(*t, part_of, remedy);
  if (ep > 1) mark_rank_local(b2, part_of, remedy);
}

namespace {

// The options every rank of the ep and of the tp group must share, doubles
// as their bits (kDoubleWords says which), the seed as whether it is set
// and its bits (kSeedWords).
constexpr size_t kDoubleWords[] = {4, 7};
constexpr size_t kSeedWords[] = {5, 6};
std::vector<std::pair<const char*, int64_t>> option_words(const MoEOptions& o,
                                                          const std::optional<uint64_t>& seed) {
  int64_t factor_bits = 0, coef_bits = 0;
  std::memcpy(&factor_bits, &o.capacity_factor, sizeof factor_bits);
  std::memcpy(&coef_bits, &o.aux_loss_coef, sizeof coef_bits);
  return {{"experts", o.experts},
          {"top_k", o.top_k},
          {"hidden", o.hidden},
          {"ffn", o.ffn},
          {"capacity_factor", factor_bits},
          {"seed", seed ? 1 : 0},
          {"seed", static_cast<int64_t>(seed.value_or(0))},
          {"aux_loss_coef", coef_bits}};
}

// Empty when every rank of `g` passed the same words, else the error.
std::string disagreement(const RankWords& all, const Communicator& g, const char* kind,
                         const std::vector<std::pair<const char*, int64_t>>& mine) {
  for (int r = 1; r < all.ranks(); ++r) {
    for (size_t i = 0; i < mine.size(); ++i) {
      if (all.of(r)[i] == all.of(0)[i]) continue;
      auto value = [&](int rank) {
        const int64_t word = all.of(rank)[i];
        if (i == kSeedWords[0] || i == kSeedWords[1]) {
          return all.of(rank)[kSeedWords[0]] == 0
                     ? std::string("none")
                     : std::to_string(static_cast<uint64_t>(all.of(rank)[kSeedWords[1]]));
        }
        if (std::find(std::begin(kDoubleWords), std::end(kDoubleWords), i) ==
            std::end(kDoubleWords))
          return std::to_string(word);
        double d = 0;
        std::memcpy(&d, &word, sizeof d);
        return double_text(d);
      };
      return "cohort: MoE (rank " + std::to_string(g.rank()) + " of " + std::to_string(g.size()) +
             ", group " + g.name() + "): " + mine[i].first + " differs across the " + kind +
             " group: rank 0 has " + value(0) + ", rank " + std::to_string(r) + " has " + value(r);
    }
  }
  return "";
}

}  // namespace

std::optional<uint64_t> MoEImpl::compared_seed() const {
  if (options_.seed) return options_.seed;
  return drawn_ ? std::optional<uint64_t>(seed_) : std::nullopt;
}

void MoEImpl::agree() const {
  // Every all-gather before any throw: a rank whose ep group disagrees still
  // joins its tp and cp groups', so no rank is left waiting on one that threw.
  const auto mine = option_words(options_, compared_seed());
  std::vector<std::pair<Communicator*, std::string>> groups = {
      {options_.ep_group.get(), "expert-parallel"},
      {options_.tp_group.get(), "tensor-parallel"},
      {options_.sequence_group.get(), "context-parallel"}};
  for (const auto& g : replicas_) groups.emplace_back(g.get(), "replica");
  std::string error;
  for (const auto& [group, kind] : groups) {
    if (!group || group->size() == 1) continue;
    std::vector<int64_t> words;
    for (const auto& w : mine) words.push_back(w.second);
    auto why = disagreement(gather_words(*group, words), *group, kind.c_str(), mine);
    if (error.empty()) error = why;
  }
  if (!error.empty()) throw MismatchError(error);
}

int64_t MoEImpl::input_refusal(const torch::Tensor& x) const {
  if (x.dim() == 0) return refusal_word(kWidth, -1);
  if (x.size(-1) != options_.hidden) return refusal_word(kWidth, x.size(-1));
  if (x.scalar_type() != router.scalar_type()) {
    return refusal_word(kDtype, static_cast<int64_t>(x.scalar_type()));
  }
  return 0;
}

int64_t MoEImpl::backward_flags(const torch::Tensor& x) const {
  if (!torch::GradMode::is_enabled()) return kNoGradMode;
  if (x.requires_grad()) return kRecords | kInputGrad;
  for (const auto* p : {&router, &w1, &b1, &w2, &b2}) {
    if (p->requires_grad()) return kRecords;
  }
  return 0;
}

void MoEImpl::refuse(const torch::Tensor& x, int64_t word, int ep_from) const {
  // The relays, innermost first: the tp group, the sequence group, the ep group.
  std::string who, group;
  auto hop = [&](int rank, const char* kind, const std::shared_ptr<Communicator>& g) {
    if (rank < 0) return;
    who += (who.empty() ? "rank " : " of rank ") + std::to_string(rank) + " of the " + kind;
    group = g->name();
  };
  hop(relayed_from(word, kTpShift), "tensor-parallel group", options_.tp_group);
  hop(relayed_from(word, kCpShift), "sequence group", options_.sequence_group);
  hop(ep_from, "expert-parallel group", options_.ep_group);
  who = who.empty() ? "this rank's input" : who + " " + group + " refused its input";
  throw InvalidArgument(where(options_) + ": " + who + ": " +
                        refusal_text(word, options_.hidden, router.scalar_type()) +
                        (group.empty() ? ", shape " + c10::str(x.sizes()) : ""));
}

void MoEImpl::check_backward(int64_t own, int64_t flags,
                             const std::vector<int64_t>& ep_words) const {
  if (!(flags & kRecords) || !(flags & (kNoGradMode | kPeerNoGradMode))) return;
  std::string who = own & kNoGradMode ? "this rank" : "";
  for (size_t r = 0; who.empty() && 2 * r < ep_words.size(); ++r) {
    const int64_t f = ep_words[2 * r + 1];
    const std::string rank =
        std::to_string(r) + " of the expert-parallel group " + options_.ep_group->name();
    if (f & kNoGradMode) {
      who = "rank " + rank;
    } else if (f & kPeerNoGradMode) {
      who = "a rank of the tensor-parallel or sequence group of rank " + rank;
    }
  }
  if (who.empty()) who = "a rank of this rank's tensor-parallel or sequence group";
  throw InvalidArgument(
      where(options_) + ": " + who +
      " runs the MoE's forward without grad mode while other ranks record its backward, whose "
      "exchanges it would never join: run the forward under the same grad mode on every rank");
}

void MoEImpl::agree_over_tp(const torch::Tensor& x, int64_t& word, int64_t& flags) const {
  const auto& tp = options_.tp_group;
  if (!tp || tp->size() == 1) return;
  // Every TP rank must route the same tokens with the same router: their
  // digests ride with the words, before anything moves.
  const int64_t input = word != 0 ? 0 : tensor_digest(x);
  const auto all = gather_words(*tp, {word, flags, input, tensor_digest(router)});
  for (int t = 0; t < all.ranks(); ++t) {
    if (t != tp->rank()) flags = merged(flags, all.of(t)[1]);
  }
  for (int t = 0; t < all.ranks() && word == 0; ++t) {
    if (all.of(t)[0] != 0) word = relayed(all.of(t)[0], t, kTpShift);
  }
  for (const auto& [at, kind] : {std::pair{2, kTpInput}, std::pair{3, kTpRouter}}) {
    for (int t = 1; t < all.ranks() && word == 0; ++t) {
      if (all.of(t)[at] != all.of(0)[at]) word = refusal_word(kind, t);
    }
  }
}

Routing MoEImpl::route_or_refuse(const torch::Tensor& x, int64_t& word, int64_t& flags) {
  const auto& seq = options_.sequence_group;
  const bool over_seq = seq && seq->size() > 1;
  if (word != 0 && !over_seq) return {};
  Routing routing;
  if (word == 0) {
    auto logits = torch::linear(x.reshape({-1, options_.hidden}), router);
    routing = expert_parallel::route(logits, options_.top_k, options_.capacity_factor);
  } else {
    // No tokens: this rank still joins the sequence group's all-reduce.
    routing.probs = torch::zeros({0, options_.experts}, router.options());
    routing.expert = torch::zeros({0}, router.options().dtype(torch::kInt64));
  }
  // Under context parallelism the loss is the whole sequences', whose
  // tokens the sequence group's ranks share; the all-reduce also carries
  // each rank's refusal and flags, which this rank relays to its ep group.
  std::vector<int64_t> all;
  aux_loss_ = (over_seq ? load_balancing_loss(routing, *seq, {word, flags}, all)
                        : load_balancing_loss(routing)) *
              options_.aux_loss_coef;
  for (int c = 0; over_seq && c < seq->size(); ++c) {
    const auto at = static_cast<size_t>(2 * c);
    if (c != seq->rank()) flags = merged(flags, all[at + 1]);
    if (word == 0 && all[at] != 0) word = relayed(all[at], c, kCpShift);
  }
  if (word == 0) dropped_ = routing.kept.numel() - routing.kept.sum().item<int64_t>();
  return routing;
}

Routing MoEImpl::route(const torch::Tensor& x) {
  int64_t word = input_refusal(x), flags = 0;
  auto routing = route_or_refuse(x, word, flags);
  if (word != 0) refuse(x, word, -1);
  return routing;
}

torch::Tensor MoEImpl::forward(const torch::Tensor& x) {
  int64_t word = input_refusal(x), flags = backward_flags(x);
  const int64_t own = flags;
  agree_over_tp(x, word, flags);
  auto routing = route_or_refuse(x, word, flags);
  return dispatch(x, routing, word, own, flags);
}

torch::Tensor MoEImpl::forward_routed(const torch::Tensor& x, const Routing& routing) {
  int64_t word = input_refusal(x), flags = backward_flags(x);
  const int64_t own = flags;
  agree_over_tp(x, word, flags);
  return dispatch(x, routing, word, own, flags);
}

torch::Tensor MoEImpl::run_experts(const torch::Tensor& rows, const std::vector<int64_t>& counts) {
  std::vector<torch::Tensor> out;
  int64_t start = 0;
  // Split over tp, each rank computes its F / tp slice of every expert's
  // hidden layer and a partial output: the input's gradient and the output
  // are sums over tp (Megatron's f and g around an MLP), b2 added once after.
  const auto& tp = options_.tp_group;
  const bool split = tp && tp->size() > 1;
  auto in = split ? tensor_parallel::copy_to_tensor_parallel_region(rows, *tp) : rows;
  // Every expert runs, even on no rows, so that its output is in the graph
  // on every rank alike.
  for (int64_t j = 0; j < local_; ++j) {
    auto chunk = in.narrow(0, start, counts[static_cast<size_t>(j)]);
    auto h = torch::gelu(torch::linear(chunk, w1[j], b1[j]));
    out.push_back(split ? torch::linear(h, w2[j]) : torch::linear(h, w2[j], b2[j]));
    start += counts[static_cast<size_t>(j)];
  }
  if (!split) return torch::cat(out);
  // The local expert of each row.
  auto expert_of_row =
      torch::repeat_interleave(torch::tensor(counts, rows.options().dtype(torch::kInt64)));
  return tensor_parallel::reduce_from_tensor_parallel_region(torch::cat(out), *tp) +
         b2.index_select(0, expert_of_row);
}

torch::Tensor MoEImpl::anchor(bool records) const {
  for (const auto* p : {&router, &w1, &b1, &w2, &b2}) {
    if (p->requires_grad()) return p->narrow(0, 0, 0);
  }
  // Every parameter frozen while some rank records: a leaf of no elements
  // puts this rank's exchanges in the graph as well.
  return records ? torch::zeros({0}, router.options()).requires_grad_() : router.narrow(0, 0, 0);
}

torch::Tensor MoEImpl::dispatch(const torch::Tensor& x, const Routing& routing, int64_t word,
                                int64_t own, int64_t flags) {
  const auto& g = options_.ep_group;
  const bool over_ep = g && g->size() > 1;
  if (word != 0) {
    // This rank cannot route, or a peer of its tp or sequence group could
    // not: join the count exchange the others are in, with no rows and the
    // refusal, so that every rank of the ep group throws, naming the rank.
    if (over_ep) {
      const auto none = torch::zeros({options_.experts}, router.options().dtype(torch::kInt64));
      exchange_counts(none, {word, flags}, *g);
    }
    refuse(x, word, -1);
  }
  const int64_t h = options_.hidden;
  auto flat = x.reshape({-1, h});
  // Kept assignments sorted by expert (stable: in claiming order within one).
  auto kept = routing.kept.nonzero().squeeze(1);
  auto by_expert =
      std::get<1>(routing.expert.index_select(0, kept).sort(c10::optional<bool>(true), 0));
  auto order = kept.index_select(0, by_expert);
  auto token = routing.token.index_select(0, order);
  auto rows = flat.index_select(0, token);
  auto counts = torch::bincount(routing.expert.index_select(0, order), {}, options_.experts);
  std::vector<int64_t> ep_words;
  torch::Tensor received;
  if (over_ep) {
    std::tie(received, ep_words) = exchange_counts(counts, {0, flags}, *g);  // [ep, local]
    for (int r = 0; r < g->size(); ++r) {
      if (ep_words[static_cast<size_t>(2 * r)] != 0)
        refuse(x, ep_words[static_cast<size_t>(2 * r)], r);
      if (r != g->rank()) flags = merged(flags, ep_words[static_cast<size_t>(2 * r + 1)]);
    }
  }
  // Every rank now holds the flags of every rank of its groups: where one
  // records the backward, each joins its exchanges (tp and ep) or, unable
  // to (no grad mode), every one throws.
  check_backward(own, flags, ep_words);
  // Empty, yet in the graph wherever some rank records: a slice of a
  // parameter that trains, else a leaf of no elements. Where the rows need
  // no gradient, the exchanges' backward still runs, as on the ranks whose
  // rows do.
  const auto anchored = anchor(flags & kRecords);
  torch::Tensor back;
  if (!over_ep) {
    const bool split = options_.tp_group && options_.tp_group->size() > 1;
    // The rows' gradient is all-reduced over tp wherever an input needs it.
    if (split && (flags & kInputGrad) && !rows.requires_grad()) rows = rows + anchored.sum();
    back = run_experts(rows, to_vector(counts));
  } else {
    auto send = to_vector(counts.view({g->size(), local_}).sum(1));
    auto recv = to_vector(received.sum(1));
    auto got = all_to_all_rows(rows, anchored, send, recv, *g);
    auto perm = expert_major(received);
    auto out = run_experts(got.index_select(0, perm), to_vector(received.sum(0)));
    back = all_to_all_rows(out.index_select(0, torch::argsort(perm)), anchored, recv, send, *g);
  }
  auto weighted = back * routing.gate.index_select(0, order).unsqueeze(1);
  return torch::zeros({flat.size(0), h}, weighted.options())
      .index_add(0, token, weighted)
      .reshape(x.sizes());
}

std::vector<torch::Tensor> expert_parameters(const torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  std::unordered_set<const void*> seen;
  model.apply([&](const torch::nn::Module& m) {
    const auto* moe = dynamic_cast<const MoEImpl*>(&m);
    if (!moe) return;
    for (const auto& t : {moe->w1, moe->b1, moe->w2, moe->b2}) {
      if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
    }
  });
  return out;
}

std::map<const void*, int64_t> expert_tensor_split_dims(const torch::nn::Module& model) {
  std::map<const void*, int64_t> dims;
  model.apply([&](const torch::nn::Module& m) {
    const auto* moe = dynamic_cast<const MoEImpl*>(&m);
    if (!moe || tp_size(moe->options()) == 1) return;
    dims[moe->w1.unsafeGetTensorImpl()] = 1;
    dims[moe->b1.unsafeGetTensorImpl()] = 1;
    dims[moe->w2.unsafeGetTensorImpl()] = 2;
  });
  return dims;
}

std::vector<torch::Tensor> non_expert_parameters(const torch::nn::Module& model) {
  std::unordered_set<const void*> experts;
  for (const auto& t : expert_parameters(model)) experts.insert(t.unsafeGetTensorImpl());
  std::vector<torch::Tensor> out;
  for (const auto& t : model.parameters()) {
    if (!experts.count(t.unsafeGetTensorImpl())) out.push_back(t);
  }
  return out;
}

namespace {

std::string moe_name(const std::string& path) {
  return path.empty() ? "the MoE" : "MoE '" + path + "'";
}

const char* const kRightGroups =
    "pass as dense the ranks that see different tokens, mesh[{\"dp\", \"ep\", \"cp\"}] (one TP "
    "rank), and as expert_replicas those holding the same experts, mesh[{\"dp\", \"cp\"}] (a "
    "dimension the mesh lacks left out)";

int cp_size(const MoEOptions& o) { return o.sequence_group ? o.sequence_group->size() : 1; }

// Why `dense` and `expert_replicas` cannot average `model`'s MoE gradients
// on this rank, or empty. Each MoE's expert gradient already sums the tokens
// of its ep group, so the dense group must be the replicas times ep: a dense
// group of the replicas alone (each ep rank's router then drifts, the
// experts' gradients ep times too large) or replicas of one rank while dp is
// above one (experts never averaged) is refused. The replicas must span the
// MoE's sequence (cp) group: its ranks hold the same experts but different
// tokens of the same sequences.
std::string group_size_error(const torch::nn::Module& model, Communicator& dense,
                             Communicator& expert_replicas) {
  const int d = dense.size(), r = expert_replicas.size();
  if (d % r != 0) {
    return "the dense group's " + std::to_string(d) + " ranks do not divide by the " +
           std::to_string(r) + " expert replicas";
  }
  std::string error;
  model.apply([&](const std::string& name, const torch::nn::Module& m) {
    const auto* moe = dynamic_cast<const MoEImpl*>(&m);
    if (!moe || !error.empty()) return;
    const int ep = moe->options().ep_group ? moe->options().ep_group->size() : 1;
    const int cp = cp_size(moe->options());
    if (d != r * ep) {
      error = "the dense group " + dense.name() + " has " + std::to_string(d) +
              " ranks, not the expert_replicas group's " + std::to_string(r) + " times the " +
              std::to_string(ep) + " of the expert-parallel group of " + moe_name(name) + ": " +
              kRightGroups;
    } else if (r % cp != 0) {
      error = "the expert_replicas group " + expert_replicas.name() + " has " + std::to_string(r) +
              " ranks, which cannot hold each of the " + std::to_string(cp) +
              " ranks of the sequence (context-parallel) group of " + moe_name(name) +
              " alike (its gradients would never be averaged over cp): " + kRightGroups;
    }
  });
  return error;
}

// Where this rank sits in each MoE of a model: its first expert, its TP
// rank and size, its ep rank, its sequence (cp) rank and size, in the order
// of model.apply.
struct Placement {
  std::vector<int64_t> firsts, tp, ep, cp;
  int64_t layers() const { return static_cast<int64_t>(firsts.size()); }
  int64_t digest(const std::vector<int64_t>& words) const {
    return static_cast<int64_t>(fnv1a_words(words));
  }
  // The ep and cp rank in every MoE: which tokens of the ep group's.
  int64_t tokens_digest() const {
    auto words = ep;
    words.insert(words.end(), cp.begin(), cp.end());
    return digest(words);
  }
};

Placement placement_of(const torch::nn::Module& model) {
  Placement p;
  model.apply([&](const torch::nn::Module& m) {
    const auto* moe = dynamic_cast<const MoEImpl*>(&m);
    if (!moe) return;
    const auto& o = moe->options();
    p.firsts.push_back(moe->first_expert());
    p.tp.push_back(o.tp_group ? o.tp_group->rank() : 0);
    p.tp.push_back(tp_size(o));
    p.ep.push_back(o.ep_group ? o.ep_group->rank() : 0);
    p.cp.push_back(o.sequence_group ? o.sequence_group->rank() : 0);
    p.cp.push_back(cp_size(o));
  });
  return p;
}

// Whether the keys (one per rank) take `kinds` values, each `times` times.
bool evenly(const RankWords& all, size_t key, int64_t kinds, int64_t times) {
  std::map<int64_t, int64_t> count;
  for (int r = 0; r < all.ranks(); ++r) ++count[all.of(r)[key]];
  bool even = static_cast<int64_t>(count.size()) == kinds;
  for (const auto& [k, n] : count) even = even && n == times;
  return even;
}

std::string cp_text(const int64_t* cp, int64_t layers, int64_t digest) {
  return "cp rank " + std::to_string(cp[0]) + " of " + std::to_string(cp[1]) +
         (layers > 1 ? " in the first MoE of " + std::to_string(layers) + ", digest " +
                           std::to_string(static_cast<uint64_t>(digest))
                     : "");
}

// Over `expert_replicas` (one all-gather): why its ranks do not hold the
// same experts and the same TP part of each, or do not hold each rank of
// the sequence group alike, or empty. Averaging another rank's experts in
// would mix different experts', or different TP slices', weights with no
// error; missing a cp rank would leave its tokens out of the experts'.
std::string replicas_error(const Placement& p, Communicator& expert_replicas) {
  if (expert_replicas.size() == 1 && (p.cp.empty() || p.cp[1] == 1)) return "";
  const int64_t n = p.layers();
  const auto all =
      gather_words(expert_replicas,
                   {n, n ? p.firsts[0] : -1, n ? p.tp[0] : -1, n ? p.tp[1] : -1, p.digest(p.firsts),
                    p.digest(p.tp), n ? p.cp[0] : 0, n ? p.cp[1] : 1, p.digest(p.cp)});
  bool same = true;
  for (int r = 0; r < all.ranks(); ++r) {
    const int64_t *w = all.of(r), *w0 = all.of(0);
    same = same && std::equal(w, w + 6, w0) && w[7] == w0[7];
  }
  if (!same) {
    const auto values = all.values([](const int64_t* w) {
      return std::to_string(w[0]) + " MoE layers, the first's first_expert() " +
             std::to_string(w[1]) + " at TP rank " + std::to_string(w[2]) + " of " +
             std::to_string(w[3]) + ", digests " + std::to_string(static_cast<uint64_t>(w[4])) +
             " and " + std::to_string(static_cast<uint64_t>(w[5]));
    });
    return "the expert_replicas group " + expert_replicas.name() +
           " holds different experts or different TP ranks' parts of them (" + name_groups(values) +
           "): " + kRightGroups;
  }
  const int64_t cp = all.of(0)[7];
  if (evenly(all, 8, cp, all.ranks() / cp)) return "";
  const auto values = all.values([n](const int64_t* w) { return cp_text(w + 6, n, w[8]); });
  return "the expert_replicas group " + expert_replicas.name() + " does not hold each of the " +
         std::to_string(cp) + " ranks of the sequence (context-parallel) group " +
         std::to_string(all.ranks() / cp) + " times (" + name_groups(values) +
         "): the experts' gradients would leave out the other cp ranks' tokens; " + kRightGroups;
}

// The words each rank of `dense` passes: its error flag, then what the
// membership check compares (dense_membership_error).
std::vector<int64_t> dense_words(const Placement& p, bool refused) {
  const int64_t n = p.layers();
  return {refused ? 1 : 0,   n,
          n ? p.tp[0] : -1,  n ? p.tp[1] : -1,
          p.digest(p.tp),    n ? p.ep[0] : -1,
          p.tokens_digest(), n ? p.cp[0] : 0,
          n ? p.cp[1] : 1};
}

// Why the ranks of `dense` (their dense_words in `all`) are not dp x ep x cp
// of one TP rank, or empty; the same text on every rank. The group sizes fit
// (group_size_error), yet the members may not: the whole world of a dp x ep
// x tp mesh (expert gradients of different TP slices averaged when the
// replicas span tp too), or dp x tp (one ep rank's tokens: each ep rank's
// router drifts apart), or dp x ep of one cp rank (the routers of the cp
// ranks drift apart). So every rank holds the same TP part, and each token
// placement (the ep and cp rank in every MoE) appears
// expert_replicas.size() / cp times.
std::string dense_membership_error(const RankWords& all, Communicator& dense, int replicas) {
  bool any_moe = false;
  for (int r = 0; r < all.ranks(); ++r) any_moe = any_moe || all.of(r)[1] != 0;
  if (!any_moe) return "";
  std::vector<std::string> parts;
  std::vector<std::string> tp, ep;
  bool tp_same = true, cp_same = true;
  for (int r = 0; r < all.ranks(); ++r) {
    const int64_t* w = all.of(r);
    tp_same = tp_same && std::equal(w + 1, w + 5, all.of(0) + 1);
    cp_same = cp_same && w[8] == all.of(0)[8];
    const std::string more = w[1] > 1 ? " in the first MoE of " + std::to_string(w[1]) : "";
    tp.push_back("TP rank " + std::to_string(w[2]) + " of " + std::to_string(w[3]) + more +
                 (w[1] > 1 ? ", digest " + std::to_string(static_cast<uint64_t>(w[4])) : ""));
    ep.push_back("ep rank " + std::to_string(w[5]) +
                 (w[8] > 1 ? ", cp rank " + std::to_string(w[7]) : "") + more +
                 (w[1] > 1 ? ", digest " + std::to_string(static_cast<uint64_t>(w[6])) : ""));
  }
  if (!tp_same) {
    parts.push_back("holds different TP ranks' parts of the experts (" + name_groups(tp) + ")");
  }
  const int64_t ep_size = static_cast<int64_t>(dense.size()) / replicas;
  const int64_t cp = cp_same ? all.of(0)[8] : 0;
  if (cp == 0 || replicas % cp != 0 || !evenly(all, 6, ep_size * cp, replicas / cp)) {
    const std::string cps = cp > 1 ? " x " + std::to_string(cp) + " cp" : "";
    const std::string times =
        cp > 0 && replicas % cp == 0 ? std::to_string(replicas / cp) : "the same number of";
    parts.push_back("holds the ep" + std::string(cp > 1 ? " and cp" : "") + " ranks unevenly (" +
                    name_groups(ep) + "), not each of the " + std::to_string(ep_size) + " ep" +
                    cps + " ranks " + times + " times" +
                    (cp > 1 ? "" : " (the expert_replicas group's size)"));
  }
  if (parts.empty()) return "";
  std::string error = "the dense group " + dense.name() + " " + parts[0];
  for (size_t i = 1; i < parts.size(); ++i) error += " and " + parts[i];
  return error + ": " + kRightGroups;
}

// Throws on every rank of `dense` unless the group sizes fit every MoE
// (group_size_error), each rank of `expert_replicas` holds the same experts
// and TP part and the replicas hold each cp rank alike (replicas_error), and
// `dense` holds dp x ep x cp of one TP rank (dense_membership_error). One
// all-gather over each group.
void check_replicas(const torch::nn::Module& model, Communicator& dense,
                    Communicator& expert_replicas) {
  const Placement p = placement_of(model);
  std::string error = group_size_error(model, dense, expert_replicas);
  const std::string replicas = replicas_error(p, expert_replicas);
  if (error.empty()) error = replicas;
  // Over dense, so that the ranks of other replica groups throw too instead
  // of waiting in the gradient average.
  const auto all = gather_words(dense, dense_words(p, !error.empty()));
  int first_bad = -1;
  for (int r = 0; r < all.ranks() && first_bad < 0; ++r) {
    if (all.of(r)[0] != 0) first_bad = r;
  }
  if (first_bad < 0) error = dense_membership_error(all, dense, expert_replicas.size());
  if (first_bad < 0 && error.empty()) return;
  throw InvalidArgument("cohort: average_moe_gradients (rank " + std::to_string(dense.rank()) +
                        " of " + std::to_string(dense.size()) + "): " +
                        (error.empty() ? "rank " + std::to_string(first_bad) +
                                             " of the dense group refused its groups (the error "
                                             "there says why)"
                                       : error));
}

}  // namespace

void average_moe_gradients(const torch::nn::Module& model, Communicator& dense,
                           Communicator& expert_replicas) {
  check_replicas(model, dense, expert_replicas);
  average_gradients(non_expert_parameters(model), dense);
  auto experts = expert_parameters(model);
  average_gradients(experts, expert_replicas);
  // The replicas' mean is ep times the dense mean: each rank's expert
  // gradient sums the tokens of its whole ep group.
  const double scale = static_cast<double>(expert_replicas.size()) / dense.size();
  torch::NoGradGuard no_grad;
  for (auto& p : experts) {
    if (p.grad().defined()) p.mutable_grad().mul_(scale);
  }
}

std::string mesh_mismatch(const torch::nn::Module& model, const DeviceMesh& mesh) {
  const auto names = mesh.dim_names();
  auto size_and_rank = [&](const char* dim) {
    const bool has = std::find(names.begin(), names.end(), dim) != names.end();
    return has ? std::pair{mesh.size(dim), mesh.local_rank(dim)} : std::pair{1, 0};
  };
  std::string error;
  model.apply([&](const std::string& name, const torch::nn::Module& m) {
    const auto* moe = dynamic_cast<const MoEImpl*>(&m);
    if (!moe || !error.empty()) return;
    // What the MoE does over each group, with it and without it.
    for (const auto& [dim, group, with, without] :
         {std::tuple{"ep", moe->options().ep_group.get(),
                     " splits its experts over its expert-parallel group ",
                     " has no expert-parallel group (its experts whole on every rank)"},
          std::tuple{"tp", moe->options().tp_group.get(),
                     " splits each expert over its tensor-parallel group ",
                     " has no tensor-parallel group (each expert whole on every rank)"},
          std::tuple{
              "cp", moe->options().sequence_group.get(),
              " counts its load-balancing loss over its sequence group ",
              " has no sequence group (its load-balancing loss over this rank's tokens only)"}}) {
      const auto [size, rank] = size_and_rank(dim);
      const int has_size = group ? group->size() : 1, has_rank = group ? group->rank() : 0;
      if (has_size == size && has_rank == rank) continue;
      const std::string has = group ? std::string(with) + group->name() + " of " +
                                          std::to_string(has_size) + " ranks (this rank at " +
                                          std::to_string(has_rank) + ")"
                                    : std::string(without);
      error = moe_name(name) + has + ", but the mesh (" + mesh.to_string() + ") has \"" + dim +
              "\" of " + std::to_string(size) + " (this rank at " + std::to_string(rank) +
              "): build it over the mesh (MoE(mesh, options))";
      return;
    }
  });
  return error;
}

}  // namespace cohort::expert_parallel
