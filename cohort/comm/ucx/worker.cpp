#include "cohort/comm/ucx/worker.h"

#include <poll.h>

#include <algorithm>
#include <thread>

#include "cohort/core/env.h"
#include "cohort/core/error.h"

namespace cohort::ucx {
namespace {

constexpr uint64_t kFullMask = ~uint64_t{0};
constexpr uint64_t kChannelMask = uint64_t{3} << 62;

uint64_t tag_of(Channel channel, int sender, int tag) {
  return (static_cast<uint64_t>(channel) << 62) | (static_cast<uint64_t>(sender) << 32) |
         static_cast<uint32_t>(tag);
}

// How long a waiter polls before it sleeps on the event fd: a reply within
// this is taken at polling latency, a longer wait costs no CPU.
// At or above this size a posted transfer wakes the engine's thread.
constexpr size_t kWakeBytes = 64 << 10;

int spin_us() {
  static const int us = env::get_int("COHORT_UCX_SPIN_US", 0, 1000000).value_or(100);
  return us;
}

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
                                       bool is_send) {
  if (failed_.load(std::memory_order_acquire)) throw_failure();
  return start(channel, std::move(t), peer, tag, is_send);
}

std::shared_ptr<Transfer> Worker::start(Channel channel, at::Tensor t, int peer, int tag,
                                        bool is_send, uint64_t mask) {
  auto x = std::make_shared<Transfer>();
  x->owner = this;
  x->peer = peer;
  x->tag = tag;
  x->channel = channel;
  x->is_send = is_send;
  x->bytes = t.nbytes();
  void* data = t.numel() ? t.data_ptr() : nullptr;
  x->buffer = std::move(t);
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.user_data = x.get();
  ucs_status_ptr_t r;
  if (is_send) {
    p.cb.send = on_sent;
    r = ucp_tag_send_nbx(endpoints_[static_cast<size_t>(peer)], data, x->bytes,
                         tag_of(channel, rank_, tag), &p);
  } else {
    // UCX 1.13 leaves recv_info unset when a receive completes at once, so
    // receives always complete through the callback, which has the length.
    p.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = on_received;
    r = ucp_tag_recv_nbx(worker_, data, x->bytes, tag_of(channel, peer, tag), mask, &p);
  }
  if (r == nullptr) {  // a send completed at once; no callback follows
    x->done.store(true, std::memory_order_release);
  } else if (UCS_PTR_IS_ERR(r)) {
    x->status = UCS_PTR_STATUS(r);
    x->done.store(true, std::memory_order_release);
  } else {
    if (channel != Channel::Control) pending_.fetch_add(1, std::memory_order_acq_rel);
    {
      std::lock_guard<std::mutex> lock(mu_);
      prune_locked();
      x->request = r;
      inflight_.push_back(x);
    }
    // A large transfer moves on while the caller computes: the engine's
    // thread starts progressing it (small ones finish in the caller's wait).
    if (x->bytes >= kWakeBytes && waiters_.load(std::memory_order_acquire) == 0) wake_idle();
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

bool Worker::progress() { return ucp_worker_progress(worker_) != 0; }

// One thread at a time sleeps on UCX's event fd: arming drains the fd, so a
// second sleeper could swallow the first one's wake-up. The others wait for
// a completion callback (wake_all) or for the sleeper's turn to end.
void Worker::block(const std::atomic<bool>* done, Millis most) {
  auto finished = [&] { return done && done->load(std::memory_order_acquire); };
  if (!sleeper_.exchange(true, std::memory_order_acq_rel)) {
    // Busy: events arrived since the last progress; the caller progresses.
    if (!finished() && !progress() && ucp_worker_arm(worker_) == UCS_OK) {
      pollfd fd{event_fd_, POLLIN, 0};
      ::poll(&fd, 1, static_cast<int>(std::max<Millis::rep>(most.count(), 1)));
    }
    sleeper_.store(false, std::memory_order_release);
    wake_all();  // a waiter may take over the fd
    return;
  }
  // Counted before the predicate is read, so that completed() either sees
  // this sleeper or its `done` is seen here (both sides fence).
  blocked_.fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  {
    std::unique_lock<std::mutex> lock(wake_mu_);
    wake_.wait_for(lock, most, [&] { return finished() || !sleeper_.load(); });
  }
  blocked_.fetch_sub(1, std::memory_order_release);
}

void Worker::wake_all() {
  std::unique_lock<std::mutex> lock(wake_mu_);
  lock.unlock();
  wake_.notify_all();
}

void Worker::completed(const Transfer& t) {
  // Counted when posted (post() increments after the call, so this may run first).
  if (t.channel != Channel::Control) pending_.fetch_sub(1, std::memory_order_acq_rel);
  // Only a thread asleep on the condition variable needs the lock and the
  // notify: a spinning waiter sees `done` itself, and this callback runs on
  // the critical path of every small collective.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (blocked_.load(std::memory_order_relaxed) > 0) wake_all();
}

void Worker::wake_idle() {
  {
    std::lock_guard<std::mutex> lock(idle_mu_);
    ++idle_generation_;
  }
  idle_.notify_all();
}

// The engine's thread between jobs. It sleeps on the event fd only while a
// transfer is pending and nobody waits for one: otherwise a waiter drives
// UCX, and an armed fd would cost a wake-up of this thread per message.
void Worker::idle(Millis most) {
  const bool busy = progress();
  // A peer's ping is answered here too, while every caller computes.
  handle_notices();
  if (busy) return;
  std::unique_lock<std::mutex> lock(idle_mu_);
  const auto generation = idle_generation_;
  if (waiters_.load(std::memory_order_acquire) == 0 &&
      pending_.load(std::memory_order_acquire) > 0) {
    lock.unlock();
    block(nullptr, most);
    return;
  }
  idle_.wait_for(lock, most, [&] { return idle_generation_ != generation; });
}

void Worker::signal() {
  ucp_worker_signal(worker_);
  wake_all();
  wake_idle();
}

void Worker::wait(Transfer& t, Clock::time_point deadline) {
  // Done already (an eager send, a check that came with the data): no
  // count of waiters, whose atomics are a share of a small collective.
  if (t.done.load(std::memory_order_acquire)) return finish(t);
  struct Waiting {  // counted while this thread drives UCX
    std::atomic<int>& n;
    explicit Waiting(std::atomic<int>& c) : n(c) { n.fetch_add(1, std::memory_order_acq_rel); }
    ~Waiting() { n.fetch_sub(1, std::memory_order_acq_rel); }
  } waiting(waiters_);
  // Only the thread running a collective waits for its messages, so it
  // alone touches checks_in_: a peer's check that shows another
  // collective ends this wait at once.
  const bool collective = t.channel == Channel::Collective && !t.check;
  // The notices, the check and the clock are looked at once per
  // kPollsPerLook idle polls, not after each: a clock read costs about
  // as much as an idle poll, and a 1 KiB all-reduce waits for a few polls
  // (README.md). A look every few microseconds still sees a notice and
  // the deadline at once.
  constexpr unsigned kPollsPerLook = 16;
  unsigned polls = 0;
  Clock::time_point spin_until{};
  while (!t.done.load(std::memory_order_acquire)) {
    if (progress() || ++polls % kPollsPerLook != 1) continue;
    check_notices();
    if (failed_.load(std::memory_order_acquire)) throw_failure();
    if (collective) verify_arrived();
    const auto now = Clock::now();
    if (polls == 1) spin_until = now + std::chrono::microseconds(spin_us());
    if (now >= deadline) {
      // Name the rank that stopped answering: the peer this rank waited
      // for may itself be waiting for another.
      throw TimeoutError("ucx: " + t.what() + " did not complete in time" +
                         probe_peers(kProbeTime));
    }
    if (now < spin_until) continue;
    // Sleep in slices, so a peer's notice is seen within 100 ms.
    block(&t.done, std::min(std::chrono::duration_cast<Millis>(deadline - now), Millis(100)));
  }
  finish(t);
}

void Worker::finish(Transfer& t) {
  if (t.check) return verify_check(t);
  if (t.status == UCS_OK && (t.is_send || t.received == t.bytes)) return;
  if (t.status == UCS_OK || t.status == UCS_ERR_MESSAGE_TRUNCATED) {
    // Inside a collective the checks name both collectives, which says
    // more than a size: give the neighbour's check (or another rank's
    // notice of it) a moment to arrive.
    if (t.channel == Channel::Collective && !checks_in_.empty()) {
      const auto until = Clock::now() + Millis(200);
      while (!failed_.load(std::memory_order_acquire) && Clock::now() < until) {
        verify_arrived();
        check_notices();
        if (!progress()) std::this_thread::yield();
      }
      if (failed_.load(std::memory_order_acquire)) throw_failure();
    }
    report_bad_receive(t);
    throw_failure();
  }
  if (failed_.load(std::memory_order_acquire)) throw_failure();
  throw PeerError("ucx: " + t.what() + " failed: " + ucs_status_string(t.status));
}

// A receive whose message did not have the buffer's size: the ranks disagree
// about the operation. The receiver fails; so does the sender, told by a
// notice on the control channel, instead of waiting for its timeout.
void Worker::report_bad_receive(const Transfer& t) {
  const bool longer = t.status == UCS_ERR_MESSAGE_TRUNCATED;
  std::string in;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in = current_locked();
  }
  fail("ucx: " + (in.empty() ? "" : in + ": ") + t.what() + ": the message (" +
           std::to_string(t.received) + " bytes) is " + (longer ? "larger" : "shorter") +
           " than the receive buffer (" + std::to_string(t.bytes) +
           " bytes): the ranks called different operations or sizes",
       true);
  auto notice = at::zeros({4}, at::kLong);
  auto* w = notice.data_ptr<int64_t>();
  w[0] = kTruncated;
  w[1] = static_cast<int64_t>(tag_of(t.channel, rank_, t.tag));  // the complainer
  w[2] = static_cast<int64_t>(t.received);
  w[3] = static_cast<int64_t>(t.bytes);
  // Not waited for: the group has failed, and close() flushes it.
  start(Channel::Control, notice, t.peer, 0, true);
}

void Worker::post_control_receive() {
  auto x = std::make_shared<Transfer>();
  x->owner = this;
  x->channel = Channel::Control;
  x->buffer = at::empty({kNoticeWords}, at::kLong);
  x->bytes = x->buffer.nbytes();
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.user_data = x.get();
  p.cb.recv = on_received;
  auto r = ucp_tag_recv_nbx(worker_, x->buffer.data_ptr(), x->bytes, tag_of(Channel::Control, 0, 0),
                            kChannelMask, &p);
  if (UCS_PTR_IS_ERR(r)) {
    throw PeerError(std::string("ucx: cannot post the control receive: ") +
                    ucs_status_string(UCS_PTR_STATUS(r)));
  }
  std::lock_guard<std::mutex> lock(mu_);
  prune_locked();
  x->request = r;
  inflight_.push_back(x);
  controls_.push_back(x);
  control_.store(x.get(), std::memory_order_release);
}

void Worker::check_notices() {
  // Notices first: a peer that announced its close and then closed its
  // endpoints is not a failure. Its notice was sent before its endpoint
  // closed, on the same connection, so it is here by the time the
  // endpoint's error is.
  handle_notices();
  if (!peer_failed_.load(std::memory_order_acquire)) return;
  for (int r = 0; r < size_; ++r) {
    const int s = peer_slots_[static_cast<size_t>(r)].status.load();
    if (s == UCS_OK || closed_cleanly(r)) continue;
    fail("ucx: the connection to rank " + std::to_string(r) + " failed (" +
             ucs_status_string(static_cast<ucs_status_t>(s)) +
             "): the peer exited or its host is unreachable",
         false);
  }
}

// One thread at a time handles the notices that have arrived, posting the
// next receive after each (which matches any notice already queued).
void Worker::handle_notices() {
  for (;;) {
    Transfer* c = control_.load(std::memory_order_acquire);
    if (!c || !c->done.load(std::memory_order_acquire)) return;
    std::unique_lock<std::mutex> lock(control_mu_, std::try_to_lock);
    if (!lock.owns_lock() || control_.load(std::memory_order_acquire) != c) return;
    if (c->status != UCS_OK) return;  // cancelled by close()
    handle_notice(c->buffer.data_ptr<int64_t>(), c->received / sizeof(int64_t));
    post_control_receive();
  }
}

int64_t Worker::closed_after(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_after_[static_cast<size_t>(peer)];
}

bool Worker::closed_cleanly(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_clean_[static_cast<size_t>(peer)];
}

void Worker::handle_notice(const int64_t* w, size_t words) {
  if (words == 4 && w[0] == kTruncated) {
    const auto word = static_cast<uint64_t>(w[1]);
    Transfer sent;  // what this rank sent, for its name
    sent.is_send = true;
    sent.peer = static_cast<int>((word >> 32) & ((uint64_t{1} << 30) - 1));
    sent.channel = static_cast<Channel>(word >> 62);
    sent.tag = static_cast<int>(static_cast<uint32_t>(word));
    const std::string size = "(" + std::to_string(w[2]) + " bytes) was " +
                             (w[2] > w[3] ? "larger" : "shorter") + " than";
    fail("ucx: " + sent.what() + ": rank " + std::to_string(sent.peer) + " reports the message " +
             size + " its receive buffer (" + std::to_string(w[3]) +
             " bytes): the ranks called different operations or sizes",
         true);
  } else if (words == static_cast<size_t>(kNoticeWords) && w[0] == kMismatch) {
    const int K = kDescriptorWords;
    const auto reporter = from_words(w + 2), other = from_words(w + 3 + K);
    std::string in;
    {
      std::lock_guard<std::mutex> lock(mu_);
      in = current_locked();
    }
    fail("ucx: collective #" + std::to_string(reporter.seq) + ": rank " + std::to_string(w[1]) +
             " called " + reporter.describe() + " but rank " + std::to_string(w[2 + K]) +
             " called " + (other.seq < 0 ? "a collective it did not describe" : other.describe()) +
             " (reported by rank " + std::to_string(w[1]) + (in.empty() ? "" : "; " + in) +
             "): the ranks called different collectives",
         true);
  } else if (words == 4 && w[0] == kPing) {
    answer_ping(static_cast<int>(w[1]), w[2]);
  } else if (words == 4 && w[0] == kPong) {
    record_pong(static_cast<int>(w[1]), w[2]);
  } else if (words == 4 && w[0] == kClosed) {
    std::lock_guard<std::mutex> lock(mu_);
    const int peer = static_cast<int>(w[1]);
    if (peer < 0 || peer >= size_) return;
    closed_after_[static_cast<size_t>(peer)] = w[2];
    closed_clean_[static_cast<size_t>(peer)] = w[3] != 0;
    if (in_collective_ && current_.seq > w[2] && failure_.empty()) {
      failure_ = "ucx: " + current_locked() + ": rank " + std::to_string(peer) +
                 " closed its communicator after " + std::to_string(w[2]) +
                 " collective(s): the ranks called different numbers of collectives";
      failure_is_mismatch_ = true;
      failed_.store(true, std::memory_order_release);
    }
  }
}

void Worker::fail(const std::string& why, bool mismatch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_.empty()) return;
  failure_ = why;
  failure_is_mismatch_ = mismatch;
  failed_.store(true, std::memory_order_release);
}

void Worker::throw_failure() {
  std::string why;
  bool mismatch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    why = failure_;
    mismatch = failure_is_mismatch_;
  }
  if (mismatch) throw MismatchError(why);
  throw PeerError(why);
}

bool TransferWork::is_completed() {
  if (!transfer_->done.load(std::memory_order_acquire)) worker_->progress();
  return transfer_->done.load(std::memory_order_acquire);
}

void TransferWork::wait(Millis timeout) { worker_->wait(*transfer_, Clock::now() + timeout); }

}  // namespace cohort::ucx
