#include "cohort/pipeline/pipeline_runtime.h"

#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <set>
#include <sstream>
#include <tuple>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/grad_sync/average_gradients.h"
#include "cohort/pipeline/schedule_validator.h"

namespace cohort::pipeline {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMetaSlots = 64;  // int64s in a boundary's shape message
constexpr int kMetaMicrobatch = 0xFFFF;
// post_receives refills the receive window once this few posted receives
// remain (the memory model, schedule_memory, follows the same rule).
constexpr size_t kRefillAt = 1;

// Messages across boundary b (stage b -> b + 1) carry tag
// 1 + ((b * 2 + dir) << 16) + micro-batch; dir 0 forward, 1 backward. Each
// (boundary, direction) owns a block of 2^16 tags (micro-batches below
// kMetaMicrobatch, the shape message at it). The blocks of kMaxStages stages
// end below 2^31; with more, a tag would wrap below zero or into another
// block, so check_local refuses them.
int message_tag(int boundary, int dir, int microbatch) {
  const int64_t tag = 1 + ((int64_t{boundary} * 2 + dir) << 16) + microbatch;
  COHORT_CHECK(tag <= std::numeric_limits<int>::max(), "pipeline message tag " << tag);
  return static_cast<int>(tag);
}
constexpr int64_t block_end(int stages) { return (int64_t{stages - 2} * 2 + 2) << 16; }
static_assert(block_end(PipelineRuntime::kMaxStages) <= std::numeric_limits<int>::max(),
              "the last boundary's tags fit in an int");
static_assert(block_end(PipelineRuntime::kMaxStages + 1) > std::numeric_limits<int>::max(),
              "kMaxStages is the most stages whose tags fit");

std::string shape_text(const std::vector<int64_t>& s, c10::ScalarType t) {
  std::ostringstream os;
  os << c10::toString(t) << '[';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

bool needs_grad(const torch::Tensor& t) { return t.defined() && t.requires_grad(); }

// One action as a complete event. Compute actions are the rank's busy time,
// sends and receives its communication (cohort-trace summary reads the
// categories); sends and receives name the peer rank, receives also the
// time blocked waiting for the message.
void trace_action(Tracer& tracer, const Action& a, Clock::time_point start, Clock::time_point end,
                  int64_t blocked_ns, int peer) {
  std::vector<TraceArg> args{TraceArg::num("stage", a.stage),
                             TraceArg::num("microbatch", a.microbatch)};
  if (peer >= 0) args.push_back(TraceArg::num("peer", peer));
  if (a.type == ActionType::RecvForward || a.type == ActionType::RecvBackward)
    args.push_back(TraceArg::num("blocked_us", static_cast<double>(blocked_ns) / 1e3));
  tracer.complete(action_type_name(a.type),
                  is_compute(a.type) ? "pipeline.compute" : "pipeline.comm", start, end,
                  std::move(args));
}

// The peer's action matching each of `rank`'s communication actions, as a
// position in the peer's list (-1 for compute actions).
std::vector<int> peer_positions(const PipelineSchedule& s, int rank) {
  using Key = std::tuple<ActionType, int, int>;
  std::vector<std::map<Key, int>> pos(s.num_ranks);
  for (int r = 0; r < s.num_ranks; ++r)
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      if (!is_compute(a.type)) pos[r][{a.type, a.stage, a.microbatch}] = static_cast<int>(i);
    }
  std::vector<int> out;
  for (const Action& a : s.actions[rank]) {
    int stage = a.stage;
    ActionType match = a.type;
    switch (a.type) {
      case ActionType::SendForward:
        stage += 1, match = ActionType::RecvForward;
        break;
      case ActionType::SendBackward:
        stage -= 1, match = ActionType::RecvBackward;
        break;
      case ActionType::RecvForward:
        stage -= 1, match = ActionType::SendForward;
        break;
      case ActionType::RecvBackward:
        stage += 1, match = ActionType::SendBackward;
        break;
      default:
        out.push_back(-1);
        continue;
    }
    out.push_back(pos[s.stage_to_rank[stage]].at({match, stage, a.microbatch}));
  }
  return out;
}

void add_gradients(const std::vector<torch::Tensor>& params,
                   const std::vector<torch::Tensor>& grads, size_t offset) {
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& g = grads[offset + i];
    if (!g.defined()) continue;
    torch::Tensor p = params[i];
    if (p.grad().defined())
      p.mutable_grad().add_(g);
    else
      p.mutable_grad() = g.detach();
  }
}

}  // namespace

// Shapes and dtypes that cross one boundary, agreed on its first message.
struct BoundaryMeta {
  bool known = false;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<c10::ScalarType> dtypes;
};

// One (stage, micro-batch) between its F and its last backward action.
struct Slot {
  Tensors inputs, outputs, input_grads;
  std::vector<WeightUnit> units;
  Tensors unit_grads;
  Tensors roots, root_grads;     // function stages keep these for W
  bool weights_pending = false;  // I ran, W has not
};

// A send not known to be complete. Gloo reports a send complete only in its
// wait, so the runtime also waits on it once the peer has visibly received
// it: when a message arrives that the peer sent after its receive action
// `peer_recv_pos` (see release_sends).
struct PendingSend {
  Work work;
  torch::Tensor tensor;
  int peer;
  int peer_recv_pos;
};

struct PipelineRuntime::State {
  std::map<std::pair<int, int>, Slot> slots;
  std::map<std::pair<int, int>, Tensors> received_inputs, received_grads;
  std::map<int, BoundaryMeta> sent_meta, recv_meta;
  std::vector<PendingSend> sends;  // until they complete
  // Per action of this rank: for a send, the position of its receive in the
  // peer's action list; for a receive, the position of its send there.
  std::vector<int> peer_pos;
  size_t running = 0;  // the action being run
  // Receives posted ahead, by (boundary, direction, micro-batch).
  std::map<std::tuple<int, int, int>, std::vector<std::pair<Work, torch::Tensor>>> posted;
  size_t post_cursor = 0;            // the next action post_receives looks at
  int live = 0, peak_live = 0;       // (stage, micro-batch) pairs holding activations
  std::vector<bool> split_backward;  // per stage: the schedule uses I/W
  std::map<int, const PipelineStage*> local;
  Tensors micro_inputs_flat;
  std::vector<Tensors> micro_inputs, micro_targets;
  std::vector<double> losses;
  int bad_loss_mb = -1;        // the first micro-batch whose loss cannot train, this step
  int64_t bad_loss_numel = 1;  // and its loss's element count
  int rank = 0;
  int64_t recv_blocked_ns = 0;  // in wait() during the current action (traced runs)
};

void PipelineRuntime::check_local(const std::string& who) const {
  if (stages_.empty()) throw InvalidArgument(who + "empty stage list (every rank holds a stage)");
  if (!loss_fn_) throw InvalidArgument(who + "no loss function");
  if (options_.recv_window < 0)
    throw InvalidArgument(who + "recv_window is " + std::to_string(options_.recv_window) +
                          " (0 or more receive actions posted ahead)");
  if (schedule_.num_microbatches <= 0)
    throw InvalidArgument(who + "zero micro-batches (schedule " + schedule_.name + ")");
  if (schedule_.num_microbatches > kMetaMicrobatch)
    throw InvalidArgument(who + "schedule " + schedule_.name + " has " +
                          std::to_string(schedule_.num_microbatches) +
                          " micro-batches, more than the 65535 a message tag can number");
  if (schedule_.num_stages > kMaxStages)
    throw InvalidArgument(who + "schedule " + schedule_.name + " has " +
                          std::to_string(schedule_.num_stages) + " stages, more than the " +
                          std::to_string(kMaxStages) + " whose message tags fit in an int");
  if (schedule_.num_ranks != group_->size())
    throw InvalidArgument(who + "schedule " + schedule_.name + " is for " +
                          std::to_string(schedule_.num_ranks) + " ranks, the group has " +
                          std::to_string(group_->size()));
  validate_schedule(schedule_);
  auto expected = schedule_.stages_of(group_->rank());
  std::vector<int> have;
  for (const auto& st : stages_) have.push_back(st.index());
  if (have != expected) {
    std::ostringstream os;
    os << who << "holds stages [";
    for (size_t i = 0; i < have.size(); ++i) os << (i ? ", " : "") << have[i];
    os << "], the schedule maps [";
    for (size_t i = 0; i < expected.size(); ++i) os << (i ? ", " : "") << expected[i];
    os << "] to it" << (expected.empty() ? " (a rank with no stage)" : "");
    throw InvalidArgument(os.str());
  }
}

// Every rank joins this exchange, even one whose local checks failed, so
// that one rank's bad input or a disagreement is an error on every rank and
// never leaves the others waiting.
void PipelineRuntime::check_agreement(const std::string& who, const std::string& local_error) {
  // stages, micro-batches, local stages, ok, a digest of the stage-to-rank map
  const std::vector<int64_t> map(schedule_.stage_to_rank.begin(), schedule_.stage_to_rank.end());
  const RankWords all =
      gather_words(*group_, {schedule_.num_stages, schedule_.num_microbatches,
                             static_cast<int64_t>(stages_.size()), local_error.empty() ? 1 : 0,
                             static_cast<int64_t>(fnv1a_words(map))});
  if (!local_error.empty()) throw InvalidArgument(local_error);
  int64_t total_local = 0;
  for (int r = 0; r < all.ranks(); ++r) {
    if (all.of(r)[3] == 0)
      throw InvalidArgument(who + "rank " + std::to_string(r) +
                            " refused the pipeline (see its error)");
    total_local += all.of(r)[2];
  }
  const auto shape = all.values([](const int64_t* f) {
    return std::to_string(f[0]) + " stages, " + std::to_string(f[1]) + " micro-batches";
  });
  if (!all_same(shape))
    throw InvalidArgument(who + "ranks disagree on the pipeline (" + name_groups(shape) + ")");
  // Every rank saw the same digests, so all of them take this branch or none.
  if (!all_same(all.values([](const int64_t* f) { return std::to_string(f[4]); })))
    throw InvalidArgument(who + describe_maps());
  if (total_local != schedule_.num_stages)
    throw InvalidArgument(who + "ranks hold " + std::to_string(total_local) +
                          " stages together, the schedule has " +
                          std::to_string(schedule_.num_stages));
}

// Collective: every rank's stage-to-rank map (the ranks agree on the number
// of stages), grouped by map, the first 64 entries of each.
std::string PipelineRuntime::describe_maps() const {
  constexpr int kShown = 64;
  const int n = schedule_.num_stages;
  const std::vector<int64_t> mine(schedule_.stage_to_rank.begin(), schedule_.stage_to_rank.end());
  const auto maps = gather_words(*group_, mine).values([&](const int64_t* map) {
    std::string text = "[";
    for (int s = 0; s < std::min(n, kShown); ++s) text += (s ? ", " : "") + std::to_string(map[s]);
    if (n <= kShown) return text + "]";
    // Maps that differ past the shown entries still form their own groups.
    const std::vector<int64_t> whole(map, map + n);
    return text + ", ...] (digest " + std::to_string(fnv1a_words(whole)) + ")";
  });
  std::string text = "ranks disagree on the stage-to-rank map (" + name_groups(maps) + ")";
  if (n > kShown)
    text += " (" + std::to_string(n) + " stages, the first " + std::to_string(kShown) + " shown)";
  return text;
}

PipelineRuntime::PipelineRuntime(std::shared_ptr<Communicator> pp_group,
                                 std::vector<PipelineStage> stages, PipelineSchedule schedule,
                                 PipelineLossFn loss_fn, PipelineOptions options)
    : group_(std::move(pp_group)),
      stages_(std::move(stages)),
      schedule_(std::move(schedule)),
      loss_fn_(std::move(loss_fn)),
      options_(options),
      state_(std::make_unique<State>()) {
  if (!group_) throw InvalidArgument("PipelineRuntime: no pipeline communicator");
  const int rank = group_->rank();
  const std::string who =
      "PipelineRuntime on rank " + std::to_string(rank) + " of group " + group_->name() + ": ";
  std::string local_error;
  try {
    check_local(who);
  } catch (const Error& e) {
    local_error = e.what();
  }
  check_agreement(who, local_error);
  if (!has_communication(schedule_)) schedule_ = add_communication(schedule_);
  state_->rank = rank;
  state_->split_backward.assign(schedule_.num_stages, false);
  for (const auto& act : schedule_.actions[rank])
    if (act.type == ActionType::BackwardInput) state_->split_backward[act.stage] = true;
  for (const auto& st : stages_) state_->local[st.index()] = &st;
  state_->peer_pos = peer_positions(schedule_, rank);
}

PipelineRuntime::~PipelineRuntime() = default;

std::vector<torch::Tensor> PipelineRuntime::parameters() const {
  // Each once: a weight two of this rank's stages share (a tied embedding
  // when one rank holds the first and the last stage) would otherwise be
  // stepped twice by an optimizer built over the list.
  std::vector<torch::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& st : stages_) {
    for (const auto& p : st.parameters()) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
    }
  }
  return out;
}

void PipelineRuntime::split_batch(const Tensors& inputs, const Tensors& targets) {
  const int m = schedule_.num_microbatches;
  auto split = [&](const Tensors& batch, const char* what, std::vector<Tensors>& out) {
    out.assign(m, {});
    if (batch.empty())
      throw InvalidArgument("PipelineRuntime::step on rank " + std::to_string(state_->rank) +
                            ": no " + what + " on the rank of stage " +
                            (what[0] == 'i' ? "0" : "the last stage"));
    for (const auto& t : batch) {
      if (t.dim() == 0 || t.size(0) % m != 0)
        throw InvalidArgument("PipelineRuntime::step on rank " + std::to_string(state_->rank) +
                              ": a batch of " + std::to_string(t.dim() ? t.size(0) : 0) + " " +
                              what + " does not split into " + std::to_string(m) +
                              " micro-batches");
      auto chunks = t.chunk(m, 0);
      for (int i = 0; i < m; ++i) out[i].push_back(chunks[i]);
    }
  };
  state_->micro_inputs.clear();
  state_->micro_targets.clear();
  if (state_->local.count(0)) split(inputs, "inputs", state_->micro_inputs);
  if (state_->local.count(schedule_.num_stages - 1))
    split(targets, "targets", state_->micro_targets);
}

PipelineStepResult PipelineRuntime::step(const Tensors& inputs, const Tensors& targets) {
  const auto t0 = Clock::now();
  split_batch(inputs, targets);
  PipelineStepResult result;
  state_->losses.assign(schedule_.num_microbatches, 0.0);
  state_->bad_loss_mb = -1;
  Tracer* const tracer = active(group_->tracer());
  TraceSpan span(tracer, "pipeline step", "pipeline.step");
  if (tracer) {
    span.arg(TraceArg::str("schedule", schedule_.name));
    span.arg(TraceArg::num("microbatches", schedule_.num_microbatches));
  }
  try {
    const std::vector<Action>& actions = schedule_.actions[state_->rank];
    state_->post_cursor = 0;
    state_->live = state_->peak_live = 0;
    for (size_t pc = 0; pc < actions.size(); ++pc) {
      post_receives(pc);
      const Action& a = actions[pc];
      state_->running = pc;
      run_action(a, result);
      if (a.type == ActionType::RecvForward || a.type == ActionType::RecvBackward) {
        const int from = a.stage + (a.type == ActionType::RecvForward ? -1 : 1);
        release_sends(schedule_.stage_to_rank[from], state_->peer_pos[pc]);
      }
      reap_sends();
    }
    result.peak_live_microbatches = state_->peak_live;
    TraceSpan finish(tracer, "finish step", "pipeline.step");
    finish_step(result);
  } catch (...) {
    state_->slots.clear();
    state_->received_inputs.clear();
    state_->received_grads.clear();
    state_->sends.clear();
    state_->posted.clear();
    throw;
  }
  result.step_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  return result;
}

void PipelineRuntime::run_action(const Action& a, PipelineStepResult& result) {
  Tracer* const tracer = active(group_->tracer());
  state_->recv_blocked_ns = 0;
  const auto t0 = Clock::now();
  switch (a.type) {
    case ActionType::Forward:
      forward(a.stage, a.microbatch);
      break;
    case ActionType::Backward:
    case ActionType::BackwardInput:
      backward(a);
      break;
    case ActionType::BackwardWeight:
      backward_weight(a.stage, a.microbatch);
      break;
    case ActionType::SendForward:
      send_forward(a.stage, a.microbatch);
      break;
    case ActionType::RecvForward:
      recv_forward(a.stage, a.microbatch);
      break;
    case ActionType::SendBackward:
      send_backward(a.stage, a.microbatch);
      break;
    case ActionType::RecvBackward:
      recv_backward(a.stage, a.microbatch);
      break;
  }
  if (tracer) {
    const bool to_next = a.type == ActionType::SendForward || a.type == ActionType::RecvBackward;
    const int peer =
        is_compute(a.type) ? -1 : schedule_.stage_to_rank[a.stage + (to_next ? 1 : -1)];
    trace_action(*tracer, a, t0, Clock::now(), state_->recv_blocked_ns, peer);
  }
  if (!options_.measure) return;
  double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (is_compute(a.type)) result.compute_ms += ms;
  result.action_ms[a.type] += ms;
  result.action_count[a.type] += 1;
  result.durations_ms.push_back(ms);
}

void PipelineRuntime::forward(int stage, int mb) {
  State& st = *state_;
  Slot& slot = st.slots[{stage, mb}];
  Tensors in;
  if (stage == 0) {
    in = st.micro_inputs[mb];
  } else {
    auto it = st.received_inputs.find({stage, mb});
    if (it != st.received_inputs.end()) {
      in = std::move(it->second);
      st.received_inputs.erase(it);
    } else {
      in = st.slots.at({stage - 1, mb}).outputs;  // the same rank: no copy
    }
    // A graph per stage, so that each stage's backward stops at its inputs.
    for (auto& t : in)
      if (t.is_floating_point()) t = t.detach().requires_grad_(true);
  }
  const PipelineStage& ps = *st.local.at(stage);
  Tensors out = ps.forward(in, st.split_backward[stage] ? &slot.units : nullptr);
  st.peak_live = std::max(st.peak_live, ++st.live);
  slot.inputs = std::move(in);
  if (stage != schedule_.num_stages - 1) {
    slot.outputs = std::move(out);
    return;
  }
  torch::Tensor loss = loss_fn_(out, st.micro_targets[mb]);
  if (loss.numel() != 1 || !loss.requires_grad()) {
    // Refused on every rank at the step's end (finish_step), not here,
    // where the other ranks wait for this micro-batch's gradients. Until
    // then a zero without a graph stands in, so every stage's backward
    // sends zeros and the schedule runs to its end.
    if (st.bad_loss_mb < 0) st.bad_loss_mb = mb, st.bad_loss_numel = loss.numel();
    st.losses[mb] = loss.numel() == 1 ? loss.item<double>() : std::nan("");
    slot.outputs = {torch::zeros({})};
    return;
  }
  st.losses[mb] = loss.item<double>();
  // The gradient convention (file comment): d(loss / m).
  slot.outputs = {loss.reshape({}) / schedule_.num_microbatches};
}

void PipelineRuntime::backward(const Action& a) {
  State& st = *state_;
  const int stage = a.stage, mb = a.microbatch;
  Slot& slot = st.slots.at({stage, mb});
  Tensors grads;
  if (stage == schedule_.num_stages - 1) {
    grads = {torch::ones_like(slot.outputs[0])};
  } else {
    auto it = st.received_grads.find({stage, mb});
    if (it != st.received_grads.end()) {
      grads = std::move(it->second);
      st.received_grads.erase(it);
    } else {
      Slot& next = st.slots.at({stage + 1, mb});
      grads = std::move(next.input_grads);
      next.input_grads.clear();
      if (!next.weights_pending) st.slots.erase({stage + 1, mb});  // W still needs it
    }
  }
  // Floating-point outputs pair with the gradients, in order.
  Tensors roots, root_grads;
  size_t gi = 0;
  for (const auto& o : slot.outputs) {
    if (!o.is_floating_point()) continue;
    COHORT_CHECK(gi < grads.size(), "stage " << stage << " has more outputs than gradients");
    if (needs_grad(o)) roots.push_back(o), root_grads.push_back(grads[gi]);
    ++gi;
  }
  // Stage 0's inputs are the batch: no stage takes their gradients.
  const bool send_back = stage > 0;
  Tensors want;
  std::vector<size_t> input_pos;
  for (size_t i = 0; send_back && i < slot.inputs.size(); ++i)
    if (needs_grad(slot.inputs[i])) want.push_back(slot.inputs[i]), input_pos.push_back(i);
  const size_t n_inputs = want.size();
  const PipelineStage& ps = *st.local.at(stage);
  const bool full = a.type == ActionType::Backward;
  const bool by_unit = !full && !slot.units.empty();
  if (full) want.insert(want.end(), ps.parameters().begin(), ps.parameters().end());
  if (by_unit)
    for (const auto& u : slot.units) want.push_back(u.output);
  Tensors got;
  if (!roots.empty() && !want.empty())
    got = torch::autograd::grad(roots, want, root_grads, /*retain_graph=*/!full,
                                /*create_graph=*/false, /*allow_unused=*/true);
  // Every floating-point input gets a gradient (zeros where unused): the
  // receiver expects one message per floating-point boundary tensor.
  slot.input_grads.clear();
  for (size_t i = 0, k = 0; send_back && i < slot.inputs.size(); ++i) {
    if (!slot.inputs[i].is_floating_point()) continue;
    torch::Tensor g;
    if (k < input_pos.size() && input_pos[k] == i) {
      if (!got.empty()) g = got[k];
      ++k;
    }
    slot.input_grads.push_back(g.defined() ? g : torch::zeros_like(slot.inputs[i]));
  }
  if (full) {
    if (!got.empty()) add_gradients(ps.parameters(), got, n_inputs);
    release_activations(stage, mb);  // `slot` may be gone
  } else if (by_unit) {
    slot.weights_pending = true;
    slot.unit_grads.assign(got.begin() + (got.empty() ? 0 : n_inputs), got.end());
    if (got.empty()) slot.units.clear();
    slot.roots.clear();
  } else {
    slot.weights_pending = true;
    slot.roots = std::move(roots), slot.root_grads = std::move(root_grads);
  }
}

void PipelineRuntime::backward_weight(int stage, int mb) {
  Slot& slot = state_->slots.at({stage, mb});
  const PipelineStage& ps = *state_->local.at(stage);
  if (!slot.units.empty()) {
    // Each layer from its own output gradient: the engine runs only the
    // nodes between that output and the layer's parameters.
    for (size_t u = 0; u < slot.units.size(); ++u) {
      const auto& unit = slot.units[u];
      if (!needs_grad(unit.output) || !slot.unit_grads[u].defined()) continue;
      auto g = torch::autograd::grad({unit.output}, unit.parameters, {slot.unit_grads[u]},
                                     /*retain_graph=*/true, false, /*allow_unused=*/true);
      add_gradients(unit.parameters, g, 0);
    }
  } else if (!slot.roots.empty() && !ps.parameters().empty()) {
    auto g =
        torch::autograd::grad(slot.roots, ps.parameters(), slot.root_grads, false, false, true);
    add_gradients(ps.parameters(), g, 0);
  }
  release_activations(stage, mb);
}

// After the micro-batch's last backward action on the stage. Its input
// gradients may still wait for their SEND_B or the previous local stage,
// which then drop the slot.
void PipelineRuntime::release_activations(int stage, int mb) {
  State& st = *state_;
  auto it = st.slots.find({stage, mb});
  Slot& slot = it->second;
  slot.inputs.clear(), slot.outputs.clear(), slot.units.clear(), slot.unit_grads.clear();
  slot.roots.clear(), slot.root_grads.clear();
  slot.weights_pending = false;
  --st.live;
  if (slot.input_grads.empty()) st.slots.erase(it);
}

// A completed send's tensor goes at once, not at the step's end: a step
// otherwise keeps every output it sent, m of them.
void PipelineRuntime::reap_sends() {
  auto& sends = state_->sends;
  auto done = std::remove_if(sends.begin(), sends.end(), [](PendingSend& s) {
    if (!s.work.is_completed()) return false;
    s.work.wait();  // a failed send throws here, naming its call
    return true;
  });
  sends.erase(done, sends.end());
}

// A message from `peer` that it sent at its action `peer_send_pos` has
// arrived. Every send of ours that the peer received at an earlier action
// has arrived too, so its wait returns at once: the engine can tell (Gloo's
// sends complete only in wait) and the tensor goes. Without this a rank
// would keep its sends until the step's end, m of them.
void PipelineRuntime::release_sends(int peer, int peer_send_pos) {
  auto& sends = state_->sends;
  auto done = std::remove_if(sends.begin(), sends.end(), [&](PendingSend& s) {
    if (s.peer != peer || s.peer_recv_pos >= peer_send_pos) return false;
    s.work.wait();
    return true;
  });
  sends.erase(done, sends.end());
}

void PipelineRuntime::send(const torch::Tensor& tensor, int dst, int tag) {
  torch::Tensor c = tensor.detach().contiguous();
  Work w = group_->send(c, dst, {tag});
  state_->sends.push_back({std::move(w), c, dst, state_->peer_pos[state_->running]});
}

void PipelineRuntime::send_forward(int stage, int mb) {
  State& st = *state_;
  const Tensors& out = st.slots.at({stage, mb}).outputs;
  const int dst = schedule_.stage_to_rank[stage + 1];
  BoundaryMeta& meta = st.sent_meta[stage];
  if (!meta.known) {
    // The boundary's shapes, once: count, then (dtype, ndim, sizes...) each.
    std::vector<int64_t> enc{static_cast<int64_t>(out.size())};
    for (const auto& t : out) {
      enc.push_back(static_cast<int64_t>(t.scalar_type()));
      enc.push_back(t.dim());
      for (auto d : t.sizes()) enc.push_back(d);
      meta.shapes.push_back(t.sizes().vec());
      meta.dtypes.push_back(t.scalar_type());
    }
    if (enc.size() > static_cast<size_t>(kMetaSlots))
      throw InvalidArgument("PipelineRuntime: stage " + std::to_string(stage) +
                            " sends too many tensors or dimensions to describe (" +
                            std::to_string(enc.size()) + " > 64 values)");
    enc.resize(kMetaSlots, 0);
    send(torch::tensor(enc, torch::kInt64), dst, message_tag(stage, 0, kMetaMicrobatch));
    meta.known = true;
  }
  bool same = out.size() == meta.shapes.size();
  for (size_t i = 0; same && i < out.size(); ++i)
    same = out[i].sizes().vec() == meta.shapes[i] && out[i].scalar_type() == meta.dtypes[i];
  if (!same) {
    std::ostringstream os;
    os << "PipelineRuntime on rank " << st.rank << ": stage " << stage << " micro-batch " << mb
       << " outputs [";
    for (size_t i = 0; i < out.size(); ++i)
      os << (i ? ", " : "") << shape_text(out[i].sizes().vec(), out[i].scalar_type());
    os << "], expected [";
    for (size_t i = 0; i < meta.shapes.size(); ++i)
      os << (i ? ", " : "") << shape_text(meta.shapes[i], meta.dtypes[i]);
    os << "] (agreed on the boundary's first message)";
    throw InvalidArgument(os.str());
  }
  for (const auto& t : out) send(t, dst, message_tag(stage, 0, mb));
}

// Once a boundary's shapes are agreed (on the first step), receives are
// posted ahead: the next recv_window receive actions from the running one
// on. A message then lands while this rank computes; posted at the receive
// action, it would wait for the receiver to ask and for the sender's
// transport to answer, on the critical path of every micro-batch. A
// receive the window did not reach is posted at its own action.
//
// The window is refilled in bursts, once at most kRefillAt posted receives
// remain, not one receive each time one is taken: every posting call in
// the middle of a step (Gloo locks the pair and notifies the peer) can
// stall a rank whose cores are shared, and a burst pays that once for
// up to window - 1 receives (docs/benchmarks.md has the measurement). The
// peak stays recv_window buffers.
void PipelineRuntime::post_receives(size_t running) {
  State& st = *state_;
  const std::vector<Action>& actions = schedule_.actions[st.rank];
  st.post_cursor = std::max(st.post_cursor, running);
  if (st.posted.size() > kRefillAt) return;
  while (st.post_cursor < actions.size() &&
         st.posted.size() < static_cast<size_t>(options_.recv_window))
    post_receive(actions[st.post_cursor++]);
}

void PipelineRuntime::post_receive(const Action& a) {
  State& st = *state_;
  const bool fwd = a.type == ActionType::RecvForward;
  if (!fwd && a.type != ActionType::RecvBackward) return;
  const int boundary = fwd ? a.stage - 1 : a.stage;
  const auto& metas = fwd ? st.recv_meta : st.sent_meta;
  auto it = metas.find(boundary);
  if (it == metas.end() || !it->second.known) return;
  const BoundaryMeta& meta = it->second;
  const int src = schedule_.stage_to_rank[fwd ? a.stage - 1 : a.stage + 1];
  const int dir = fwd ? 0 : 1;
  auto& list = st.posted[{boundary, dir, a.microbatch}];
  for (size_t i = 0; i < meta.shapes.size(); ++i) {
    if (!fwd && !c10::isFloatingType(meta.dtypes[i])) continue;  // no gradient
    torch::Tensor buf = torch::empty(meta.shapes[i], torch::TensorOptions().dtype(meta.dtypes[i]));
    Work w = group_->recv(buf, src, {message_tag(boundary, dir, a.microbatch), options_.timeout});
    list.emplace_back(std::move(w), buf);
  }
}

bool PipelineRuntime::take_posted(int boundary, int dir, int mb, Tensors& out) {
  auto it = state_->posted.find({boundary, dir, mb});
  if (it == state_->posted.end()) return false;
  const bool traced = active(group_->tracer()) != nullptr;
  for (auto& [work, buf] : it->second) {
    const auto start = traced ? Clock::now() : Clock::time_point{};
    work.wait();
    if (traced)
      state_->recv_blocked_ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    out.push_back(buf);
  }
  state_->posted.erase(it);
  return true;
}

Work PipelineRuntime::wait_recv(torch::Tensor& buffer, int src, int tag) {
  Work w = group_->recv(buffer, src, {tag, options_.timeout});
  if (!active(group_->tracer())) {
    w.wait();
    return w;
  }
  const auto start = Clock::now();
  w.wait();
  state_->recv_blocked_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  return w;
}

void PipelineRuntime::recv_forward(int stage, int mb) {
  State& st = *state_;
  const int src = schedule_.stage_to_rank[stage - 1];
  Tensors in;
  if (take_posted(stage - 1, 0, mb, in)) {
    st.received_inputs[{stage, mb}] = std::move(in);
    return;
  }
  BoundaryMeta& meta = st.recv_meta[stage - 1];
  if (!meta.known) {
    torch::Tensor m = torch::empty({kMetaSlots}, torch::kInt64);
    wait_recv(m, src, message_tag(stage - 1, 0, kMetaMicrobatch));
    auto a = m.accessor<int64_t, 1>();
    int64_t k = 1;
    for (int64_t i = 0; i < a[0]; ++i) {
      meta.dtypes.push_back(static_cast<c10::ScalarType>(a[k]));
      int64_t nd = a[k + 1];
      meta.shapes.emplace_back(&a[k + 2], &a[k + 2] + nd);
      k += 2 + nd;
    }
    meta.known = true;
  }
  for (size_t i = 0; i < meta.shapes.size(); ++i) {
    torch::Tensor buf = torch::empty(meta.shapes[i], torch::TensorOptions().dtype(meta.dtypes[i]));
    wait_recv(buf, src, message_tag(stage - 1, 0, mb));
    in.push_back(buf);
  }
  st.received_inputs[{stage, mb}] = std::move(in);
}

void PipelineRuntime::send_backward(int stage, int mb) {
  State& st = *state_;
  Slot& slot = st.slots.at({stage, mb});
  Tensors grads = std::move(slot.input_grads);
  slot.input_grads.clear();
  const int dst = schedule_.stage_to_rank[stage - 1];
  for (const auto& g : grads) send(g, dst, message_tag(stage - 1, 1, mb));
  if (!slot.weights_pending) st.slots.erase({stage, mb});  // W still needs it
}

void PipelineRuntime::recv_backward(int stage, int mb) {
  State& st = *state_;
  const int src = schedule_.stage_to_rank[stage + 1];
  Tensors grads;
  if (take_posted(stage, 1, mb, grads)) {
    st.received_grads[{stage, mb}] = std::move(grads);
    return;
  }
  for (const auto& o : st.slots.at({stage, mb}).outputs) {
    if (!o.is_floating_point()) continue;
    torch::Tensor buf = torch::empty_like(o, torch::MemoryFormat::Contiguous);
    wait_recv(buf, src, message_tag(stage, 1, mb));
    grads.push_back(buf);
  }
  st.received_grads[{stage, mb}] = std::move(grads);
}

void PipelineRuntime::finish_step(PipelineStepResult& result) {
  State& st = *state_;
  for (auto& pending : st.sends) pending.work.wait();
  st.sends.clear();
  st.slots.clear();
  // Per-micro-batch losses from the last stage's rank to every rank, then
  // the first micro-batch whose loss was refused (-1: none) and its size.
  std::vector<double> message = st.losses;
  message.push_back(st.bad_loss_mb);
  message.push_back(static_cast<double>(st.bad_loss_numel));
  torch::Tensor losses = torch::tensor(message, torch::kFloat64);
  BroadcastOptions opts;
  opts.root = schedule_.stage_to_rank.back();
  group_->broadcast(losses, opts).wait();
  const double* got = losses.data_ptr<double>();
  const int m = schedule_.num_microbatches;
  if (got[m] >= 0) throw InvalidArgument(loss_error(static_cast<int>(got[m]), got[m + 1]));
  result.losses.assign(got, got + m);
  double sum = 0;
  for (double l : result.losses) sum += l;
  result.loss = sum / result.losses.size();
}

// The same text on every rank but for the rank's own number.
std::string PipelineRuntime::loss_error(int mb, double numel) const {
  const int last = schedule_.num_stages - 1;
  const std::string where = "stage " + std::to_string(last) + " micro-batch " + std::to_string(mb) +
                            " (on rank " + std::to_string(schedule_.stage_to_rank.back()) + ")";
  std::ostringstream os;
  os << "PipelineRuntime on rank " << state_->rank << " of group " << group_->name() << ": ";
  if (numel != 1) {
    os << "the loss function returned " << static_cast<int64_t>(numel) << " elements for " << where
       << ", not a scalar";
  } else {
    os << "the loss of " << where
       << " does not require grad (computed under NoGradGuard, or from detached outputs?): the "
          "step would train nothing";
  }
  return os.str();
}

void all_reduce_gradients(const std::vector<torch::Tensor>& params, Communicator& dp_group) {
  average_gradients(params, dp_group);
}

}  // namespace cohort::pipeline
