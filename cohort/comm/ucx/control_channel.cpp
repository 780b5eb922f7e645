#include "cohort/comm/ucx/control_channel.h"

#include <thread>

#include "cohort/comm/ucx/worker.h"
#include "cohort/core/error.h"
#include "cohort/core/process_identity.h"

namespace cohort::ucx {
namespace {

// A control receive matches the channel alone: any sender, any tag.
constexpr uint64_t kChannelMask = uint64_t{3} << 62;

}  // namespace

ControlChannel::ControlChannel(Worker& worker, int rank, int size)
    : worker_(worker),
      rank_(rank),
      size_(size),
      closed_after_(new std::atomic<int64_t>[static_cast<size_t>(size)]),
      closed_clean_(new std::atomic<bool>[static_cast<size_t>(size)]),
      answered_(new std::atomic<int64_t>[static_cast<size_t>(size)]),
      pinged_at_(new std::atomic<int64_t>[static_cast<size_t>(size)]) {
  for (size_t q = 0; q < static_cast<size_t>(size); ++q) {
    closed_after_[q].store(std::numeric_limits<int64_t>::max());
    closed_clean_[q].store(false);
    answered_[q].store(0);
    pinged_at_[q].store(std::numeric_limits<int64_t>::min());
  }
}

at::Tensor ControlChannel::notice(Notice type, int64_t a, int64_t b, int64_t c) {
  auto t = at::zeros({4}, at::kLong);
  auto* w = t.data_ptr<int64_t>();
  w[0] = type;
  w[1] = a;
  w[2] = b;
  w[3] = c;
  return t;
}

void ControlChannel::post_receive() {
  std::lock_guard<std::mutex> lock(mu_);
  post_receive_locked();
}

void ControlChannel::post_receive_locked() {
  // Through the Worker's in-flight list, so the close cancels it.
  auto x = worker_.start(Channel::Control, at::empty({kNoticeWords}, at::kLong), 0, 0, false,
                         kChannelMask);
  if (x->done.load(std::memory_order_acquire) && x->status != UCS_OK) {
    throw PeerError(std::string("ucx: cannot post the control receive: ") +
                    ucs_status_string(x->status));
  }
  controls_.push_back(x);
  current_.store(x.get(), std::memory_order_release);
}

void ControlChannel::handle() {
  for (;;) {
    Transfer* c = current_.load(std::memory_order_acquire);
    if (!c || !c->done.load(std::memory_order_acquire)) return;
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || current_.load(std::memory_order_acquire) != c) return;
    if (c->status != UCS_OK) return;  // cancelled by the close
    on_notice(c->buffer.data_ptr<int64_t>(), c->received / sizeof(int64_t));
    post_receive_locked();
  }
}

void ControlChannel::send(const at::Tensor& notice, int peer) {
  // Not waited for: the close flushes it.
  worker_.start(Channel::Control, notice, peer, 0, true);
}

void ControlChannel::send_all(const at::Tensor& notice) {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) send(notice, q);
  }
}

void ControlChannel::notify_bad_message(const Transfer& t) {
  // The complainer and what it received in the tag's word; the sizes; the
  // dtypes.
  auto n = at::zeros({kBadMessageWords}, at::kLong);
  auto* w = n.data_ptr<int64_t>();
  w[0] = kBadMessage;
  w[1] = static_cast<int64_t>(tag_of(t.channel, rank_, t.tag));
  w[2] = static_cast<int64_t>(t.received);
  w[3] = static_cast<int64_t>(t.bytes);
  w[4] = t.sender_dtype();
  w[5] = t.dtype;
  send(n, t.peer);
}

void ControlChannel::notify_mismatch(const Signature& mine, int peer, const Signature& theirs) {
  auto n = at::zeros({kNoticeWords}, at::kLong);
  auto* w = n.data_ptr<int64_t>();
  w[0] = kMismatch;
  w[1] = rank_;
  to_words(mine, w + 2);
  w[2 + kDescriptorWords] = peer;
  to_words(theirs, w + 3 + kDescriptorWords);
  send_all(n);
}

void ControlChannel::notify_closed(int64_t collectives, bool clean) {
  send_all(notice(kClosed, rank_, collectives, clean ? 1 : 0));
}

void ControlChannel::on_notice(const int64_t* w, size_t words) {
  if (words == static_cast<size_t>(kBadMessageWords) && w[0] == kBadMessage) {
    on_bad_message(w);
  } else if (words == static_cast<size_t>(kNoticeWords) && w[0] == kMismatch) {
    on_mismatch(w);
  } else if (words == 4 && w[0] == kPing) {
    const int peer = static_cast<int>(w[1]);
    if (peer >= 0 && peer < size_ && peer != rank_) {
      // Not waited for: the asking rank waits for it.
      send(notice(kPong, rank_, w[2], 0), peer);
      pinged_at_[static_cast<size_t>(peer)].store(Clock::now().time_since_epoch().count(),
                                                  std::memory_order_release);
    }
  } else if (words == 4 && w[0] == kPong) {
    const int peer = static_cast<int>(w[1]);
    if (peer >= 0 && peer < size_) answered(peer, w[2]);
  } else if (words == 4 && w[0] == kClosed) {
    on_closed(static_cast<int>(w[1]), w[2], w[3] != 0);
  }
}

void ControlChannel::answered(int peer, int64_t round) {
  // Only ever raised: a late pong from an earlier round (another thread's
  // probe) must not hide one of the current round.
  auto& a = answered_[static_cast<size_t>(peer)];
  int64_t seen = a.load(std::memory_order_acquire);
  while (seen < round && !a.compare_exchange_weak(seen, round, std::memory_order_acq_rel)) {
  }
}

void ControlChannel::on_bad_message(const int64_t* w) {
  const auto word = static_cast<uint64_t>(w[1]);
  Transfer sent;  // what this rank sent, for its name
  sent.is_send = true;
  sent.peer = sender_of(word);
  sent.channel = static_cast<Channel>(word >> 62);
  sent.tag = static_cast<int>(static_cast<uint32_t>(word));
  worker_.failure_.fail("ucx: " + sent.what() + ": rank " + std::to_string(sent.peer) +
                            " reports " +
                            bad_message(w[2], static_cast<int>(w[4]), w[3], static_cast<int>(w[5]),
                                        "was", "its receive buffer"),
                        true);
}

void ControlChannel::on_mismatch(const int64_t* w) {
  const int K = kDescriptorWords;
  const auto reporter = from_words(w + 2), other = from_words(w + 3 + K);
  const std::string in = worker_.check_.current();
  worker_.failure_.fail(
      mismatch_message("ucx", reporter, static_cast<int>(w[2 + K]), other,
                       "rank " + std::to_string(w[1]),
                       "reported by rank " + std::to_string(w[1]) + (in.empty() ? "" : "; " + in)),
      true);
}

void ControlChannel::on_closed(int peer, int64_t collectives, bool clean) {
  if (peer < 0 || peer >= size_) return;
  // Clean first: a reader that sees the count closed also sees how.
  closed_clean_[static_cast<size_t>(peer)].store(clean, std::memory_order_release);
  closed_after_[static_cast<size_t>(peer)].store(collectives, std::memory_order_release);
  const std::string why = worker_.check_.outlived(peer, collectives);
  if (!why.empty()) worker_.failure_.fail(why, true);
}

// A timed-out wait asks every peer whether it still answers, so the error
// names the rank that stopped (a SIGSTOP, a debugger, a hang) instead of
// only the neighbour this rank was waiting for, which may itself be waiting
// for the stopped one. A peer answers from whichever of its threads handles
// notices: a waiter, or the engine's thread between jobs (at least every
// 100 ms), so a rank that only computes still answers; a stopped one does not.
std::string ControlChannel::probe(Millis most) {
  if (size_ == 1) return "";
  const int64_t round = ++probe_round_;
  const auto ping = notice(kPing, rank_, round, 0);
  std::vector<int> asked;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || closed_after(q) != std::numeric_limits<int64_t>::max()) continue;
    send(ping, q);
    asked.push_back(q);
  }
  // A peer that asked this rank within the probe's window is alive too,
  // past its own timeout: when two ranks time out together, each knows the
  // other from its ping alone, without depending on the other's thread to
  // answer in time on a loaded machine.
  const int64_t recent = (Clock::now() - most).time_since_epoch().count();
  auto silent = [&] {
    std::vector<int> s;
    for (int q : asked) {
      const auto i = static_cast<size_t>(q);
      if (answered_[i].load(std::memory_order_acquire) < round &&
          pinged_at_[i].load(std::memory_order_acquire) < recent) {
        s.push_back(q);
      }
    }
    return s;
  };
  const auto until = Clock::now() + most;
  while (!silent().empty() && Clock::now() < until) {
    const bool busy = worker_.progress();
    handle();
    if (!busy) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const auto quiet = silent();
  if (quiet.empty()) return asked.empty() ? "" : "; every peer still answers";
  // A silent peer on this machine is named with what /proc says of its
  // process: a SIGKILLed one is gone, and on shared memory UCX does not
  // notice (the wait timed out); the others may be stopped, hung or elsewhere.
  std::vector<std::string> described;
  for (int q : quiet) described.push_back(worker_.processes_[static_cast<size_t>(q)]);
  std::vector<int> other;
  std::string text = silent_processes(quiet, described, most, other);
  if (!other.empty()) {
    text += "; " + name_ranks(other) + " did not answer within " + std::to_string(most.count()) +
            " ms: stopped (SIGSTOP, a debugger) or hung";
  }
  return text + (quiet.size() < asked.size() ? ", while the other peers answered" : "");
}

}  // namespace cohort::ucx
