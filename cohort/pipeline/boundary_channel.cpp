#include "cohort/pipeline/boundary_channel.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <sstream>

#include "cohort/core/error.h"
#include "cohort/pipeline/pipeline_runtime.h"

namespace cohort::pipeline {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMetaSlots = 64;       // int64s in a boundary's shape message
constexpr int64_t kFailedMeta = -1;  // its count when nothing crosses
// begin_action refills the receive window once this few posted receives
// remain (the memory model, schedule_memory, follows the same rule).
constexpr size_t kRefillAt = 1;

// Each (boundary, direction) owns a block of 2^16 tags (micro-batches below
// kMetaMicrobatch, the shape message at it). The blocks of kMaxStages stages
// end below 2^31; with more, a tag would wrap below zero or into another
// block, so the runtime refuses them at construction.
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

// What goes on the wire for `t`: a complex tensor as its real view (the
// Communicator moves real dtypes only), sharing its storage, so a receive
// into it fills the complex buffer.
torch::Tensor wire(const torch::Tensor& t) { return t.is_complex() ? torch::view_as_real(t) : t; }

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

}  // namespace

int message_tag(int boundary, int dir, int microbatch) {
  const int64_t tag = 1 + ((int64_t{boundary} * 2 + dir) << 16) + microbatch;
  COHORT_CHECK(tag <= std::numeric_limits<int>::max(), "pipeline message tag " << tag);
  return static_cast<int>(tag);
}

BoundaryChannel::BoundaryChannel(Communicator& group, const PipelineSchedule& schedule,
                                 Millis timeout, int recv_window,
                                 std::map<int, c10::Device> devices)
    : group_(group),
      schedule_(schedule),
      timeout_(timeout),
      recv_window_(static_cast<size_t>(recv_window)),
      rank_(group.rank()),
      actions_(schedule.actions[rank_]),
      peer_pos_(peer_positions(schedule, rank_)),
      devices_(std::move(devices)) {}

torch::Tensor BoundaryChannel::buffer(int stage, const std::vector<int64_t>& shape,
                                      c10::ScalarType dtype) const {
  const auto it = devices_.find(stage);
  const c10::Device device = it == devices_.end() ? c10::Device(c10::kCPU) : it->second;
  return torch::empty(shape, torch::TensorOptions().dtype(dtype).device(device));
}

// Once a boundary's shapes are known for the step (its shape message has
// arrived, or for gradients this rank sent the outputs), receives are
// posted ahead: the next recv_window receive actions from the running one
// on. A message then lands while this rank computes; posted at the receive
// action, it would wait for the receiver to ask and for the sender's
// transport to answer, on the critical path of every micro-batch. A
// receive the window did not reach is posted at its own action. The window
// stops at a receive whose boundary's shapes are not known yet: that
// receive reads the shape message at its own action, and the window goes
// on from there.
//
// The window is refilled in bursts, once at most kRefillAt posted receives
// remain, not one receive each time one is taken: every posting call in
// the middle of a step (Gloo locks the pair and notifies the peer) can
// stall a rank whose cores are shared, and a burst pays that once for
// up to window - 1 receives (docs/benchmarks.md has the measurement). The
// peak stays recv_window buffers.
// A batch of another shape (a short last batch, a padded length that
// varies) sends new shape messages; one seen before reuses its shapes, so
// a steady shape costs no message and no window stop. The cache is bounded:
// every rank clears it at the same step (the keys arrive in one order).
void BoundaryChannel::begin_step(int64_t input_shapes) {
  constexpr size_t kMaxKnownShapes = 64;
  if (known_.size() >= kMaxKnownShapes && !known_.count(input_shapes)) known_.clear();
  const KnownShapes& known = known_[input_shapes];
  sent_meta_ = known.sent;
  recv_meta_ = known.recv;
  step_key_ = input_shapes;
  sent_cached_.clear();
  for (const auto& entry : known.sent) sent_cached_.insert(entry.first);
  refused_.clear();
  upstream_failed_ = false;
}

void BoundaryChannel::begin_action(size_t pc) {
  if (pc == 0) post_cursor_ = 0;
  running_ = pc;
  post_cursor_ = std::max(post_cursor_, pc);
  if (posted_.size() > kRefillAt) return;
  while (post_cursor_ < actions_.size() && posted_.size() < recv_window_ &&
         post_receive(actions_[post_cursor_]))
    ++post_cursor_;
}

void BoundaryChannel::end_action(size_t pc) {
  const Action& a = actions_[pc];
  if (a.type == ActionType::RecvForward || a.type == ActionType::RecvBackward) {
    const int from = a.stage + (a.type == ActionType::RecvForward ? -1 : 1);
    release_sends(schedule_.stage_to_rank[from], peer_pos_[pc]);
  }
  reap_sends();
}

bool BoundaryChannel::post_receive(const Action& a) {
  const bool fwd = a.type == ActionType::RecvForward;
  if (!fwd && a.type != ActionType::RecvBackward) return true;
  const int boundary = fwd ? a.stage - 1 : a.stage;
  const auto& metas = fwd ? recv_meta_ : sent_meta_;
  auto it = metas.find(boundary);
  if (it == metas.end() || !it->second.known) return false;
  const BoundaryMeta& meta = it->second;
  const int src = schedule_.stage_to_rank[fwd ? a.stage - 1 : a.stage + 1];
  const int dir = fwd ? 0 : 1;
  auto& list = posted_[{boundary, dir, a.microbatch}];
  for (size_t i = 0; i < meta.shapes.size(); ++i) {
    if (!fwd && !carries_gradient(meta.dtypes[i])) continue;  // no gradient
    // Into stage a.stage: its inputs (forward) or its outputs' gradients.
    torch::Tensor buf = buffer(a.stage, meta.shapes[i], meta.dtypes[i]);
    torch::Tensor on_wire = wire(buf);
    Work w = group_.recv(on_wire, src, {message_tag(boundary, dir, a.microbatch), timeout_});
    list.emplace_back(std::move(w), buf);
  }
  return true;
}

bool BoundaryChannel::take_posted(int boundary, int dir, int mb, Tensors& out) {
  auto it = posted_.find({boundary, dir, mb});
  if (it == posted_.end()) return false;
  for (auto& [work, buf] : it->second) {
    wait_timed(work);
    out.push_back(buf);
  }
  posted_.erase(it);
  return true;
}

// Waits; in traced runs also counts the time blocked.
void BoundaryChannel::wait_timed(Work& work) {
  if (!active(group_.tracer())) {
    work.wait();
    return;
  }
  const auto start = Clock::now();
  work.wait();
  blocked_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

void BoundaryChannel::wait_recv(const torch::Tensor& buffer, int src, int tag) {
  torch::Tensor on_wire = wire(buffer);
  Work w = group_.recv(on_wire, src, {tag, timeout_});
  wait_timed(w);
}

int64_t BoundaryChannel::take_blocked_ns() { return std::exchange(blocked_ns_, 0); }

void BoundaryChannel::send(const torch::Tensor& tensor, int dst, int tag) {
  torch::Tensor c = wire(tensor.detach().contiguous());
  Work w = group_.send(c, dst, {tag});
  sends_.push_back({std::move(w), c, dst, peer_pos_[running_]});
}

// A completed send's tensor goes at once, not at the step's end: a step
// otherwise keeps every output it sent, m of them.
void BoundaryChannel::reap_sends() {
  auto done = std::remove_if(sends_.begin(), sends_.end(), [](PendingSend& s) {
    if (!s.work.is_completed()) return false;
    s.work.wait();  // a failed send throws here, naming its call
    return true;
  });
  sends_.erase(done, sends_.end());
}

// A message from `peer` that it sent at its action `peer_send_pos` has
// arrived. Every send of ours that the peer received at an earlier action
// has arrived too, so its wait returns at once: the engine can tell (Gloo's
// sends complete only in wait) and the tensor goes. Without this a rank
// would keep its sends until the step's end, m of them.
void BoundaryChannel::release_sends(int peer, int peer_send_pos) {
  auto done = std::remove_if(sends_.begin(), sends_.end(), [&](PendingSend& s) {
    if (s.peer != peer || s.peer_recv_pos >= peer_send_pos) return false;
    s.work.wait();
    return true;
  });
  sends_.erase(done, sends_.end());
}

std::optional<Tensors> BoundaryChannel::send_forward(int stage, int mb, const Tensors& out,
                                                     bool skipped) {
  const int dst = schedule_.stage_to_rank[stage + 1];
  BoundaryMeta& meta = sent_meta_[stage];
  if (!meta.known && skipped) return send_failed_meta(stage, dst, meta);
  if (!meta.known) {
    // The boundary's shapes, once a step: count, then (dtype, ndim,
    // sizes...) each.
    std::vector<int64_t> enc{static_cast<int64_t>(out.size())};
    for (const auto& t : out) {
      enc.push_back(static_cast<int64_t>(t.scalar_type()));
      enc.push_back(t.dim());
      for (auto d : t.sizes()) enc.push_back(d);
    }
    if (enc.size() > static_cast<size_t>(kMetaSlots)) {
      if (refused_.empty())
        refused_ = sender(stage, mb, dst) + ": too many tensors or dimensions to describe (" +
                   std::to_string(enc.size()) + " > " + std::to_string(kMetaSlots) + " values)";
      return send_failed_meta(stage, dst, meta);
    }
    for (const auto& t : out) {
      meta.shapes.push_back(t.sizes().vec());
      meta.dtypes.push_back(t.scalar_type());
    }
    enc.resize(kMetaSlots, 0);
    send(torch::tensor(enc, torch::kInt64), dst, message_tag(stage, 0, kMetaMicrobatch));
    meta.known = true;
  }
  if (meta.failed) return Tensors{};
  std::string refusal = skipped ? "" : mismatch(stage, mb, dst, out, meta);
  if (!skipped && refusal.empty()) {
    for (const auto& t : out) send(t, dst, message_tag(stage, 0, mb));
    return std::nullopt;
  }
  // The receiver has posted (or will post) buffers of the boundary's
  // shapes, which no message can tell it to change: zeros of those shapes
  // go instead, so its schedule, and every other rank's, runs to its end.
  if (refused_.empty()) refused_ = std::move(refusal);
  // On the stage's device (a skipped stage has no outputs to take it from).
  Tensors stand_in;
  for (size_t i = 0; i < meta.shapes.size(); ++i) {
    stand_in.push_back(
        out.empty()
            ? buffer(stage, meta.shapes[i], meta.dtypes[i]).zero_()
            : torch::zeros(meta.shapes[i],
                           torch::TensorOptions().dtype(meta.dtypes[i]).device(out[0].device())));
    send(stand_in.back(), dst, message_tag(stage, 0, mb));
  }
  return stand_in;
}

// The receiver learns from it that no tensor crosses the boundary in this
// step (it skips its stages too); the slot holds no output, so no gradient
// comes back either.
Tensors BoundaryChannel::send_failed_meta(int stage, int dst, BoundaryMeta& meta) {
  std::vector<int64_t> enc(kMetaSlots, 0);
  enc[0] = kFailedMeta;
  send(torch::tensor(enc, torch::kInt64), dst, message_tag(stage, 0, kMetaMicrobatch));
  meta = BoundaryMeta{};
  meta.known = meta.failed = true;
  return {};
}

std::string BoundaryChannel::sender(int stage, int mb, int dst) const {
  return "stage " + std::to_string(stage) + " on rank " + std::to_string(rank_) +
         ", sending micro-batch " + std::to_string(mb) + " to rank " + std::to_string(dst);
}

// "" when `out` matches the boundary's shapes, else the refusal.
std::string BoundaryChannel::mismatch(int stage, int mb, int dst, const Tensors& out,
                                      const BoundaryMeta& meta) const {
  bool same = out.size() == meta.shapes.size();
  for (size_t i = 0; same && i < out.size(); ++i)
    same = out[i].sizes().vec() == meta.shapes[i] && out[i].scalar_type() == meta.dtypes[i];
  if (same) return "";
  std::ostringstream os;
  os << sender(stage, mb, dst) << ": outputs [";
  for (size_t i = 0; i < out.size(); ++i)
    os << (i ? ", " : "") << shape_text(out[i].sizes().vec(), out[i].scalar_type());
  os << "], expected [";
  for (size_t i = 0; i < meta.shapes.size(); ++i)
    os << (i ? ", " : "") << shape_text(meta.shapes[i], meta.dtypes[i]);
  if (sent_cached_.count(stage))
    os << "] (what an earlier step with the same input shapes sent across this boundary: a "
          "stage's output shapes must follow from stage 0's input shapes)";
  else
    os << "] (the step's first micro-batch on this boundary: the micro-batches of one step cross "
          "it in one shape)";
  return os.str();
}

Tensors BoundaryChannel::recv_forward(int stage, int mb) {
  const int src = schedule_.stage_to_rank[stage - 1];
  Tensors in;
  if (take_posted(stage - 1, 0, mb, in)) return in;
  BoundaryMeta& meta = recv_meta_[stage - 1];
  if (!meta.known) {
    torch::Tensor m = torch::empty({kMetaSlots}, torch::kInt64);
    wait_recv(m, src, message_tag(stage - 1, 0, kMetaMicrobatch));
    auto a = m.accessor<int64_t, 1>();
    meta.known = true;
    if (a[0] == kFailedMeta) {
      meta.failed = upstream_failed_ = true;
      return in;
    }
    int64_t k = 1;
    for (int64_t i = 0; i < a[0]; ++i) {
      meta.dtypes.push_back(static_cast<c10::ScalarType>(a[k]));
      int64_t nd = a[k + 1];
      meta.shapes.emplace_back(&a[k + 2], &a[k + 2] + nd);
      k += 2 + nd;
    }
  }
  for (size_t i = 0; i < meta.shapes.size(); ++i) {
    torch::Tensor buf = buffer(stage, meta.shapes[i], meta.dtypes[i]);
    wait_recv(buf, src, message_tag(stage - 1, 0, mb));
    in.push_back(buf);
  }
  return in;
}

void BoundaryChannel::send_backward(int stage, int mb, const Tensors& grads) {
  const int dst = schedule_.stage_to_rank[stage - 1];
  for (const auto& g : grads) send(g, dst, message_tag(stage - 1, 1, mb));
}

Tensors BoundaryChannel::recv_backward(int stage, int mb, const Tensors& outputs) {
  const int src = schedule_.stage_to_rank[stage + 1];
  Tensors grads;
  if (take_posted(stage, 1, mb, grads)) return grads;
  for (const auto& o : outputs) {
    if (!carries_gradient(o.scalar_type())) continue;
    torch::Tensor buf = torch::empty_like(o, torch::MemoryFormat::Contiguous);
    wait_recv(buf, src, message_tag(stage, 1, mb));
    grads.push_back(buf);
  }
  return grads;
}

void BoundaryChannel::finish() {
  for (auto& pending : sends_) pending.work.wait();
  sends_.clear();
  // Both ends of a boundary know it failed: neither keeps it.
  auto kept = [](std::map<int, BoundaryMeta> metas) {
    for (auto it = metas.begin(); it != metas.end();)
      it = it->second.failed ? metas.erase(it) : ++it;
    return metas;
  };
  known_[step_key_] = {kept(sent_meta_), kept(recv_meta_)};
}

void BoundaryChannel::abort() {
  sends_.clear();
  posted_.clear();
}

}  // namespace cohort::pipeline
