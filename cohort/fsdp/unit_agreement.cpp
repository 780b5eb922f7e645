#include "cohort/fsdp/unit_agreement.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/grad_sync/parameter_check.h"

namespace cohort::fsdp {
namespace {

// Both agreements move the same number of words, so that a rank building a
// unit while another runs a schedule meets a readable error, not a size
// mismatch; the first word says which agreement a rank is in.
constexpr int64_t kWords = 18;
constexpr int64_t kUnitMagic = 0x4653445055524543;      // "FSDPUREC"
constexpr int64_t kScheduleMagic = 0x4653445053434845;  // "FSDPSCHE"
constexpr size_t kNameWords = 5;                        // 40 characters of the module's name

std::string who_on(const std::string& who, const Communicator& comm) {
  return who + " on rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
}

// Unit record words: [magic, refused, units, inner, params, numel, shapes,
// reshard, 4 policy words, 5 name words, TP parts].
enum UnitWord { kMagic, kRefused, kUnits, kInner, kParams, kNumel, kShapes, kReshard, kPolicy };
constexpr size_t kName = kPolicy + 4;
constexpr size_t kTpParts = kName + kNameWords;

int64_t dtype_code(const std::optional<torch::Dtype>& d) {
  return d ? static_cast<int64_t>(*d) : -1;
}
std::optional<torch::Dtype> dtype_of(int64_t code) {
  if (code < 0) return std::nullopt;
  return static_cast<torch::Dtype>(code);
}

std::vector<int64_t> encode(const UnitRecord& u) {
  std::vector<int64_t> w(kWords, 0);
  w[kMagic] = kUnitMagic;
  w[kRefused] = u.refusal.empty() ? 0 : 1;
  w[kUnits] = u.units;
  w[kInner] = static_cast<int64_t>(u.inner);
  w[kParams] = u.params;
  w[kNumel] = u.numel;
  w[kShapes] = static_cast<int64_t>(u.shapes);
  w[kReshard] = u.reshard_after_forward.code();
  w[kPolicy] = dtype_code(u.policy.param_dtype);
  w[kPolicy + 1] = dtype_code(u.policy.reduce_dtype);
  w[kPolicy + 2] = dtype_code(u.policy.output_dtype);
  w[kPolicy + 3] = u.policy.cast_forward_inputs ? 1 : 0;
  std::memcpy(&w[kName], u.module.data(), std::min(u.module.size(), kNameWords * 8));
  w[kTpParts] = static_cast<int64_t>(u.tp_parts);
  return w;
}

std::string module_of(const int64_t* w) {
  std::string s(reinterpret_cast<const char*>(w + kName), kNameWords * 8);
  return s.substr(0, s.find('\0'));
}

MixedPrecisionPolicy policy_of(const int64_t* w) {
  MixedPrecisionPolicy p;
  p.param_dtype = dtype_of(w[kPolicy]);
  p.reduce_dtype = dtype_of(w[kPolicy + 1]);
  p.output_dtype = dtype_of(w[kPolicy + 2]);
  p.cast_forward_inputs = w[kPolicy + 3] != 0;
  return p;
}

}  // namespace

uint64_t UnitRecord::digest() const {
  UnitRecord copy = *this;
  copy.refusal.clear();
  return fnv1a_words(encode(copy));
}

void agree_unit(Communicator& comm, const UnitRecord& mine, const std::string& who) {
  const int n = comm.size();
  if (n == 1) {
    if (!mine.refusal.empty()) throw InvalidArgument(who_on(who, comm) + ": " + mine.refusal);
    return;
  }
  const RankWords all = gather_words(comm, encode(mine));
  const auto magic = all.values([](const int64_t* w) {
    return w[kMagic] == kUnitMagic ? "wrapping a unit" : "running a fully sharded model";
  });
  if (!all_same(magic)) {
    throw MismatchError(who_on(who, comm) +
                        ": the ranks are not all wrapping a unit: " + name_groups(magic));
  }
  const auto refused = all.values([](const int64_t* w) {
    return w[kRefused] ? std::string("refuses it") : std::string("accepts it");
  });
  if (!all_same(refused)) {
    if (!mine.refusal.empty()) throw InvalidArgument(who_on(who, comm) + ": " + mine.refusal);
    throw MismatchError(
        who_on(who, comm) +
        ": a rank refuses to wrap this unit (its own error says why): " + name_groups(refused));
  }
  if (!mine.refusal.empty()) throw InvalidArgument(who_on(who, comm) + ": " + mine.refusal);

  std::vector<std::string> clauses;
  auto clause = [&](const std::string& what, const std::function<std::string(const int64_t*)>& f) {
    const auto values = all.values(f);
    if (!all_same(values)) clauses.push_back(what + ": " + name_groups(values));
  };
  clause("the wrapped module and the units in its tree differ", [](const int64_t* w) {
    return module_of(w) + " with " + std::to_string(w[kUnits]) + " unit(s) in its tree";
  });
  if (clauses.empty()) {
    clause(
        "the units inside it differ (their order, parameters or options; each was checked "
        "when it was wrapped, so a rank wrapped them in another order or changed one since)",
        [](const int64_t* w) { return "digest " + std::to_string(w[kInner]); });
  }
  clause("its own parameters differ", [](const int64_t* w) {
    return std::to_string(w[kParams]) + " parameter(s) of " + std::to_string(w[kNumel]) +
           " elements (dtypes and shapes digest " + std::to_string(w[kShapes]) + ")";
  });
  clause("reshard_after_forward differs",
         [](const int64_t* w) { return ReshardAfterForward::from_code(w[kReshard]).to_string(); });
  for (int r = 1; r < n; ++r) {
    const int64_t* first = all.of(0) + kPolicy;
    const int64_t* other = all.of(r) + kPolicy;
    if (std::equal(first, first + 4, other)) continue;
    clauses.push_back(
        "the mixed precision policy differs across ranks: " + describe(policy_of(all.of(0))) +
        " on rank 0 but " + describe(policy_of(all.of(r))) + " on rank " + std::to_string(r));
    break;
  }
  if (clauses.empty()) {
    const auto parts = all.values([](const int64_t* w) { return std::to_string(w[kTpParts]); });
    if (!all_same(parts))
      refuse_mixed_tensor_parallel_parts(comm, mine.own_params, mine.own_names, who);
    return;
  }
  std::string msg = who_on(who, comm) +
                    ": the ranks disagree on the unit (every rank must wrap the same units, in "
                    "the same order, with the same options): ";
  for (size_t i = 0; i < clauses.size(); ++i) msg += (i ? "; and " : "") + clauses[i];
  throw MismatchError(msg);
}

ScheduleCheck::ScheduleCheck(std::shared_ptr<Communicator> comm, std::vector<std::string> units,
                             std::vector<std::string> owners)
    : comm_(std::move(comm)), units_(std::move(units)), owner_(std::move(owners)) {}

void ScheduleCheck::set_settings(std::vector<int64_t> flags) {
  settings_ = fnv1a_words(flags);
  flags_ = std::move(flags);
}

void ScheduleCheck::set_sync(std::vector<int64_t> per_unit) {
  sync_ = fnv1a_words(per_unit);
  sync_flags_ = std::move(per_unit);
}

void agree_refusal(Communicator& comm, const std::string& refusal, const std::string& who) {
  if (comm.size() == 1) {
    if (!refusal.empty()) throw InvalidArgument(who_on(who, comm) + ": " + refusal);
    return;
  }
  const RankWords all = gather_words(comm, {refusal.empty() ? 0 : 1});
  const auto refused = all.values(
      [](const int64_t* w) { return std::string(w[0] ? "refuses to go on" : "can go on"); });
  if (!refusal.empty()) throw InvalidArgument(who_on(who, comm) + ": " + refusal);
  if (!all_same(refused)) {
    throw InvalidArgument(who_on(who, comm) + ": a rank cannot go on (its own error says why): " +
                          name_groups(refused));
  }
}

// Schedule words: [magic, step, unit, pass, settings, sync, refused,
// kept gathered, 0...].
void ScheduleCheck::before(ScheduleStep step, size_t unit, const std::string& refusal) {
  const int n = comm_->size();
  const std::string who = who_on("fully_shard", *comm_);
  if (n == 1) {
    if (!refusal.empty()) throw InvalidArgument(who + ": " + refusal);
    return;
  }
  std::vector<int64_t> mine(kWords, 0);
  mine[0] = kScheduleMagic;
  mine[1] = static_cast<int64_t>(step);
  mine[2] = unit == kNoUnit ? -1 : static_cast<int64_t>(unit);
  mine[3] = pass_;
  mine[4] = static_cast<int64_t>(settings_);
  mine[5] = static_cast<int64_t>(sync_);
  mine[6] = refusal.empty() ? 0 : 1;
  mine[7] = kept_gathered_ ? 1 : 0;
  const RankWords all = gather_words(*comm_, mine);
  // Before the comparison: a rank that refuses may be anywhere else.
  const auto refused = all.values([](const int64_t* w) {
    return std::string(w[0] == kScheduleMagic && w[6] ? "refuses to go on" : "can go on");
  });
  if (!refusal.empty()) throw InvalidArgument(who + ": " + refusal);
  if (!all_same(refused)) {
    throw InvalidArgument(
        who + ": a rank cannot go on (its own error says why): " + name_groups(refused));
  }
  const auto where = all.values([this](const int64_t* w) { return describe(w); });
  if (!all_same(where)) {
    // A rank that still holds an earlier forward's output skips the
    // all-gathers of the units that output keeps gathered: not control flow.
    const auto kept = all.values([](const int64_t* w) {
      return std::string(w[0] == kScheduleMagic && w[7] ? "units still gathered" : "none");
    });
    const std::string why =
        all_same(kept)
            ? ". Every rank must run the same units' forwards in the same order and call "
              "backward on the same outputs (rank-dependent control flow that skips or adds a "
              "unit cannot be sharded)"
            : ". At this forward's start the ranks differ in whether units were still gathered, "
              "as the output of an earlier training forward that no backward ran through keeps "
              "them (or a reshard that was refused): " +
                  name_groups(kept) +
                  ". Drop such an output, or run its backward, on every rank before the next "
                  "forward";
    throw MismatchError(
        who + ": the ranks are at different points of the fully sharded model's schedule: " +
        name_groups(where) + why);
  }
  const auto sync = all.values([](const int64_t* w) { return std::to_string(w[5]); });
  if (!all_same(sync)) throw MismatchError(who + ": " + describe_sync());
  const auto settings = all.values([](const int64_t* w) { return std::to_string(w[4]); });
  if (!all_same(settings)) throw MismatchError(who + ": " + describe_settings());
}

std::string ScheduleCheck::describe(const int64_t* w) const {
  if (w[0] != kScheduleMagic) return "wrapping a unit (fully_shard)";
  const auto unit = w[2] < 0 ? kNoUnit : static_cast<size_t>(w[2]);
  const std::string name =
      unit == kNoUnit
          ? "the root"
          : "unit '" + (unit < units_.size() ? units_[unit] : std::to_string(unit)) + "'";
  std::string what;
  switch (static_cast<ScheduleStep>(w[1])) {
    case ScheduleStep::kForwardGather:
      what = "all-gather of " + name + " for its forward";
      break;
    case ScheduleStep::kBackwardGather:
      what = "all-gather of " + name + " for its backward";
      break;
    case ScheduleStep::kReduceScatter:
      what = "reduce-scatter of the gradients of " + name;
      break;
    case ScheduleStep::kGradientPresence:
      what = "the end of backward";
      break;
    case ScheduleStep::kBuffers:
      what = "the broadcast of the buffers before a forward";
      break;
    case ScheduleStep::kUnshard:
      what = "unshard() of every unit";
      break;
    default:
      what = "step " + std::to_string(w[1]);
  }
  return what + " (forward #" + std::to_string(w[3]) + ")";
}

std::string ScheduleCheck::describe_sync() {
  const RankWords all = gather_words(*comm_, sync_flags_);
  for (size_t u = 0; u < sync_flags_.size(); ++u) {
    const auto values =
        all.values([u](const int64_t* w) { return std::string(w[u] ? "on" : "off"); });
    if (all_same(values)) continue;
    return "gradient sync (set_requires_gradient_sync) of unit '" + units_[u] +
           "' differs across ranks: " + name_groups(values) + " (set it alike on every rank)";
  }
  return "gradient sync (set_requires_gradient_sync) differs across ranks";
}

std::string ScheduleCheck::describe_settings() {
  const RankWords all = gather_words(*comm_, flags_);
  for (size_t i = 0; i < flags_.size(); ++i) {
    // A flag, or a unit's post-forward group size (N >= 2: hpZ).
    const auto values = all.values([i](const int64_t* w) {
      return w[i] == 0   ? std::string("false")
             : w[i] == 1 ? std::string("true")
                         : std::to_string(w[i]);
    });
    if (all_same(values)) continue;
    return owner_[i] + " differs across ranks: " + name_groups(values) +
           " (set it alike on every rank before the forward)";
  }
  return "the units' settings differ across ranks";
}

}  // namespace cohort::fsdp
