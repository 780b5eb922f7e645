// The Worker's part in naming collectives that differ across ranks
// (collective_check.h): each collective's checks, their verification,
// and the notices that tell every rank of the group.
#include <limits>

#include "cohort/comm/ucx/worker.h"
#include "cohort/core/error.h"

namespace cohort::ucx {
namespace {

// A check-slot receive matches the channel, the sender and kCheckBit, and
// takes whatever the low 31 bits hold (the fused descriptor).
constexpr uint64_t kCheckMask = ~uint64_t{0} & ~uint64_t{kCheckBit - 1};

}  // namespace

std::string Worker::current_locked() const {
  if (!in_collective_) return "";
  return "collective #" + std::to_string(current_.seq) + " (this rank called " +
         current_.describe() + ")";
}

void Worker::begin_collective(const Descriptor& d, std::vector<int64_t> send_counts,
                              std::vector<int64_t> recv_counts) {
  checks_in_.clear();
  checks_out_.clear();
  send_counts_ = std::move(send_counts);
  recv_counts_ = std::move(recv_counts);
  std::lock_guard<std::mutex> lock(mu_);
  current_ = d;
  in_collective_ = true;
  collectives_ = d.seq;
  for (int q = 0; q < size_ && failure_.empty(); ++q) {
    const int64_t n = closed_after_[static_cast<size_t>(q)];
    if (n >= d.seq) continue;
    failure_ = "ucx: " + current_locked() + ": rank " + std::to_string(q) +
               " closed its communicator after " + std::to_string(n) +
               " collective(s): the ranks called different numbers of collectives";
    failure_is_mismatch_ = true;
    failed_.store(true, std::memory_order_release);
  }
}

Descriptor Worker::for_peer(int peer, bool sent) {
  Descriptor d;
  {
    std::lock_guard<std::mutex> lock(mu_);
    d = current_;
  }
  const auto& counts = sent ? send_counts_ : recv_counts_;
  if (!counts.empty()) d.count = counts[static_cast<size_t>(peer)];
  return d;
}

// To every peer, not to a neighbour only: each rank then compares every
// other rank's call itself, so none finishes a collective another rank
// called differently (with a ring, a rank whose neighbours agree could
// finish before the notice of a rank further on arrived).
void Worker::post_check() {
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    // Receive first: the peer's check then never waits unexpected.
    post_check_receive(at::empty({kDescriptorWords}, at::kLong), q);
    auto words = at::empty({kDescriptorWords}, at::kLong);
    to_words(for_peer(q, true), words.data_ptr<int64_t>());
    checks_out_.push_back(post(Channel::Collective, words, q, static_cast<int>(kCheckBit), true));
  }
}

std::shared_ptr<Transfer> Worker::post_check_receive(at::Tensor t, int peer) {
  if (failed_.load(std::memory_order_acquire)) throw_failure();
  // Marked before UCX may complete it: a callback only sets done.
  auto x = start(Channel::Collective, std::move(t), peer, static_cast<int>(kCheckBit), false,
                 kCheckMask);
  x->check = true;
  checks_in_.push_back(x);
  return x;
}

void Worker::end_collective(Clock::time_point deadline, bool ok) {
  struct End {  // the collective ends however this returns
    Worker& w;
    ~End() {
      w.checks_in_.clear();
      w.checks_out_.clear();
      std::lock_guard<std::mutex> lock(w.mu_);
      w.in_collective_ = false;
    }
  } end{*this};
  if (!ok) return;
  for (auto& c : checks_in_) wait(*c, deadline);
  for (auto& c : checks_out_) wait(*c, deadline);
}

void Worker::verify_arrived() {
  for (auto& c : checks_in_) {
    if (!c->verified && c->done.load(std::memory_order_acquire)) verify_check(*c);
  }
}

void Worker::verify_check(Transfer& t) {
  if (t.verified) return;
  if (t.status != UCS_OK && t.status != UCS_ERR_MESSAGE_TRUNCATED) {
    if (failed_.load(std::memory_order_acquire)) throw_failure();
    throw PeerError("ucx: " + t.what() + " failed: " + ucs_status_string(t.status));
  }
  t.verified = true;
  const Descriptor mine = for_peer(t.peer, false);
  const auto low = static_cast<uint32_t>(t.sender_tag);
  if (low & kFusedBit) {
    const auto theirs = from_fused_tag(low, mine.seq);
    if (theirs != mine) mismatch(t.peer, theirs);
    return;
  }
  if (t.status != UCS_OK || t.received != kDescriptorWords * sizeof(int64_t)) {
    // Only a fused receive's buffer is larger than a check: a peer's data
    // in the check slot that does not say what it is.
    Descriptor unknown;
    unknown.seq = -1;
    mismatch(t.peer, unknown);
  }
  const auto theirs = from_words(static_cast<const int64_t*>(t.buffer.data_ptr()));
  if (theirs != mine) mismatch(t.peer, theirs);
}

void Worker::mismatch(int peer, const Descriptor& theirs) {
  const Descriptor mine = for_peer(peer, false);
  fail(mismatch_message("ucx", mine, peer, theirs), true);
  // Every rank of the group learns it now, not at its timeout: the others
  // may be waiting for ranks that already gave up.
  auto notice = at::zeros({kNoticeWords}, at::kLong);
  auto* w = notice.data_ptr<int64_t>();
  w[0] = kMismatch;
  w[1] = rank_;
  to_words(mine, w + 2);
  w[2 + kDescriptorWords] = peer;
  to_words(theirs, w + 3 + kDescriptorWords);
  notify_all(notice);
  throw_failure();
}

void Worker::notify_all(const at::Tensor& notice) {
  // Not waited for: close() flushes them.
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) start(Channel::Control, notice, q, 0, true);
  }
}

}  // namespace cohort::ucx
