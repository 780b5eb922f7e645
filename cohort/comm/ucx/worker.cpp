#include "cohort/comm/ucx/worker.h"

#include <algorithm>
#include <thread>

#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"

namespace cohort::ucx {
namespace {

// UCX's completion callbacks: record, then publish with `done`.
void on_sent(void*, ucs_status_t status, void* user) {
  auto* t = static_cast<Transfer*>(user);
  t->status = status;
  t->done.store(true, std::memory_order_release);
  t->owner->completed(*t);
}

void on_received(void*, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
  auto* t = static_cast<Transfer*>(user);
  t->status = status;
  if (info) {
    t->received = info->length;
    t->sender_tag = info->sender_tag;
  }
  t->done.store(true, std::memory_order_release);
  t->owner->completed(*t);
}

}  // namespace

std::string Transfer::what() const {
  if (check) return "the collective check from rank " + std::to_string(peer);
  std::string s = (is_send ? "send to rank " : "receive from rank ") + std::to_string(peer);
  if (channel == Channel::User) return s + " (tag " + std::to_string(tag) + ")";
  return s + " (the engine's collective message)";
}

std::shared_ptr<Transfer> Worker::post(Channel channel, at::Tensor t, int peer, int tag,
                                       bool is_send, int dtype) {
  if (failure_.failed()) failure_.rethrow();
  return start(channel, std::move(t), peer, tag, is_send, ~uint64_t{0}, dtype);
}

std::shared_ptr<Transfer> Worker::start(Channel channel, at::Tensor t, int peer, int tag,
                                        bool is_send, uint64_t mask, int dtype) {
  auto x = std::make_shared<Transfer>();
  x->owner = this;
  x->peer = peer;
  x->tag = tag;
  x->channel = channel;
  x->is_send = is_send;
  x->bytes = t.nbytes();
  x->dtype = dtype;
  void* data = t.numel() ? t.data_ptr() : nullptr;
  x->buffer = std::move(t);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.user_data = x.get();
  ucs_status_ptr_t r;
  if (is_send) {
    p.cb.send = on_sent;
    r = ucp_tag_send_nbx(endpoints_[static_cast<size_t>(peer)], data, x->bytes,
                         tag_of(channel, rank_, tag, dtype_code(dtype)), &p);
  } else {
    // UCX 1.13 leaves recv_info unset when a receive completes at once, so
    // receives always complete through the callback, which has the length.
    p.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = on_received;
    r = ucp_tag_recv_nbx(worker_, data, x->bytes, tag_of(channel, peer, tag), mask & ~kDtypeField,
                         &p);
  }
  if (r == nullptr) {  // a send completed at once; no callback follows
    x->done.store(true, std::memory_order_release);
  } else if (UCS_PTR_IS_ERR(r)) {
    x->status = UCS_PTR_STATUS(r);
    x->done.store(true, std::memory_order_release);
  } else {
    progress_.posted(channel != Channel::Control);
    {
      std::lock_guard<std::mutex> lock(mu_);
      prune_locked();
      x->request = r;
      inflight_.push_back(x);
    }
    // A large transfer moves on while the caller computes: the engine's
    // thread starts progressing it (small ones finish in the caller's wait).
    progress_.hand_over(x->bytes);
  }
  return x;
}

// Requests are freed here only, under mu_, so a cancel (also under mu_)
// never meets a freed request. UCX's own lock orders the free against the
// completion callback.
void Worker::prune_locked() {
  auto done = [](const std::shared_ptr<Transfer>& t) {
    if (!t->done.load(std::memory_order_acquire)) return false;
    ucp_request_free(t->request);
    t->request = nullptr;
    return true;
  };
  inflight_.erase(std::remove_if(inflight_.begin(), inflight_.end(), done), inflight_.end());
}

// The engine's thread between jobs. A peer's ping is answered here too,
// while every caller computes.
void Worker::idle(Millis most) {
  const bool busy = progress_.poll();
  control_.handle();
  if (!busy) progress_.idle_sleep(most);
}

void Worker::wait(Transfer& t, Clock::time_point deadline) {
  // Done already (an eager send, a check that came with the data): no
  // count of waiters, whose atomics are a share of a small collective.
  if (t.done.load(std::memory_order_acquire)) return finish(t);
  // Only the thread running a collective waits for its messages, so it
  // alone looks at the checks: a peer's check that shows another
  // collective ends this wait at once.
  const bool collective = t.channel == Channel::Collective && !t.check;
  const bool done = progress_.drive(t.done, deadline, [&] {
    check_notices();
    if (failure_.failed()) failure_.rethrow();
    if (collective) check_.verify_arrived();
  });
  if (!done) {
    // Name the rank that stopped answering: the peer this rank waited for
    // may itself be waiting for another. Still driving while it asks.
    Progress::Driving driving(progress_);
    throw TimeoutError("ucx: " + t.what() + " did not complete in time" +
                       control_.probe(kProbeTime));
  }
  finish(t);
}

// Whether a receive's message has its buffer's dtype, where both sides
// named one (user messages): the compare of two tag fields, the whole cost.
static bool same_dtype(const Transfer& t) {
  return t.dtype < 0 || t.sender_dtype() < 0 || t.dtype == t.sender_dtype();
}

void Worker::finish(Transfer& t) {
  if (t.check) return check_.verify(t);
  if (t.status == UCS_OK && (t.is_send || (t.received == t.bytes && same_dtype(t)))) return;
  if (t.status == UCS_OK || t.status == UCS_ERR_MESSAGE_TRUNCATED) {
    // Inside a collective the checks name both collectives, which says
    // more than a size: give the neighbour's check (or another rank's
    // notice of it) a moment to arrive.
    if (t.channel == Channel::Collective && check_.active()) {
      const auto until = Clock::now() + Millis(200);
      while (!failure_.failed() && Clock::now() < until) {
        check_.verify_arrived();
        check_notices();
        if (!progress_.poll()) std::this_thread::yield();
      }
      if (failure_.failed()) failure_.rethrow();
    }
    report_bad_receive(t);
    failure_.rethrow();
  }
  if (failure_.failed()) failure_.rethrow();
  throw PeerError("ucx: " + t.what() + " failed: " + ucs_status_string(t.status));
}

// A receive whose message did not have the buffer's size or dtype: the
// ranks disagree about the operation. The receiver fails; so does the
// sender, told by a notice on the control channel, instead of waiting for
// its timeout.
void Worker::report_bad_receive(const Transfer& t) {
  const std::string in = check_.current();
  failure_.fail("ucx: " + (in.empty() ? "" : in + ": ") + t.what() + ": " +
                    bad_message(static_cast<int64_t>(t.received), t.sender_dtype(),
                                static_cast<int64_t>(t.bytes), t.dtype, "is", "the receive buffer"),
                true);
  control_.notify_bad_message(t);
}

void Worker::check_notices() {
  // Notices first: a peer that announced its close and then closed its
  // endpoints is not a failure. Its notice was sent before its endpoint
  // closed, on the same connection, so it is here by the time the
  // endpoint's error is.
  control_.handle();
  if (!peer_failed_.load(std::memory_order_acquire)) return;
  for (int r = 0; r < size_; ++r) {
    const int s = peer_slots_[static_cast<size_t>(r)].status.load();
    if (s == UCS_OK || control_.closed_cleanly(r)) continue;
    failure_.fail("ucx: the connection to rank " + std::to_string(r) + " failed (" +
                      ucs_status_string(static_cast<ucs_status_t>(s)) +
                      "): the peer exited or its host is unreachable",
                  false);
  }
}

bool TransferWork::is_completed() {
  if (!transfer_->done.load(std::memory_order_acquire)) worker_->progress();
  return transfer_->done.load(std::memory_order_acquire);
}

void TransferWork::wait(Millis timeout) { worker_->wait(*transfer_, Clock::now() + timeout); }

}  // namespace cohort::ucx
