#include "cohort/comm/ucx/collective_check.h"

#include "cohort/comm/ucx/worker.h"
#include "cohort/core/error.h"

namespace cohort::ucx {
namespace {

// Fused tags: elements in the low 21 bits, then 3 bits of op, 5 of dtype.
constexpr int kCountBits = 21;
constexpr int kOpBits = 3;
constexpr int kDtypeBits = 5;

// A check-slot receive matches the channel, the sender and kCheckBit, and
// takes whatever the low 31 bits hold (the fused descriptor).
constexpr uint64_t kCheckMask = ~uint64_t{0} & ~uint64_t{kCheckBit - 1};

}  // namespace

std::optional<uint32_t> fused_tag(const Descriptor& d) {
  if (d.kind != Kind::AllReduce || d.root >= 0 || d.dtype < 0 || d.op < 0 || d.count < 0 ||
      d.layout != 0 || d.own_block_differs || d.dtype >= (1 << kDtypeBits) ||
      d.op >= (1 << kOpBits) || d.count >= (1 << kCountBits)) {
    return std::nullopt;
  }
  return kCheckBit | kFusedBit | (static_cast<uint32_t>(d.dtype) << (kCountBits + kOpBits)) |
         (static_cast<uint32_t>(d.op) << kCountBits) | static_cast<uint32_t>(d.count);
}

Descriptor from_fused_tag(uint32_t tag, int64_t seq) {
  Descriptor d;
  d.seq = seq;
  d.kind = Kind::AllReduce;
  d.count = tag & ((1u << kCountBits) - 1);
  d.op = static_cast<int>((tag >> kCountBits) & ((1u << kOpBits) - 1));
  d.dtype = static_cast<int>((tag >> (kCountBits + kOpBits)) & ((1u << kDtypeBits) - 1));
  return d;
}

std::string CollectiveCheck::current_locked() const {
  if (!in_collective_) return "";
  return "collective #" + std::to_string(current_.seq) + " (this rank called " +
         current_.describe() + ")";
}

std::string CollectiveCheck::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_locked();
}

std::string CollectiveCheck::outlived(int peer, int64_t collectives) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!in_collective_ || current_.seq <= collectives) return "";
  return "ucx: " + current_locked() + ": rank " + std::to_string(peer) +
         " closed its communicator after " + std::to_string(collectives) +
         " collective(s): the ranks called different numbers of collectives";
}

int64_t CollectiveCheck::begun() const {
  std::lock_guard<std::mutex> lock(mu_);
  return collectives_;
}

bool CollectiveCheck::inside() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_collective_;
}

void CollectiveCheck::begin(const Descriptor& d, std::vector<int64_t> send_counts,
                            std::vector<int64_t> recv_counts) {
  checks_in_.clear();
  checks_out_.clear();
  send_counts_ = std::move(send_counts);
  recv_counts_ = std::move(recv_counts);
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = d;
    in_collective_ = true;
    collectives_ = d.seq;
  }
  // A peer that closed before this collective never runs it. Read without
  // a lock first: this runs before every collective.
  for (int q = 0; q < size_; ++q) {
    const int64_t n = worker_.control_.closed_after(q);
    if (n >= d.seq) continue;
    const std::string why = outlived(q, n);
    if (!why.empty()) worker_.failure_.fail(why, true);
  }
}

Descriptor CollectiveCheck::for_peer(int peer, bool sent) {
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
void CollectiveCheck::post() {
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    // Receive first: the peer's check then never waits unexpected.
    post_receive(at::empty({kDescriptorWords}, at::kLong), q);
    auto words = at::empty({kDescriptorWords}, at::kLong);
    to_words(for_peer(q, true), words.data_ptr<int64_t>());
    checks_out_.push_back(
        worker_.post(Channel::Collective, words, q, static_cast<int>(kCheckBit), true));
  }
}

std::shared_ptr<Transfer> CollectiveCheck::post_receive(at::Tensor t, int peer) {
  if (worker_.failure_.failed()) worker_.failure_.rethrow();
  // Marked after the post: a completion callback only sets `done`.
  auto x = worker_.start(Channel::Collective, std::move(t), peer, static_cast<int>(kCheckBit),
                         false, kCheckMask);
  x->check = true;
  checks_in_.push_back(x);
  return x;
}

void CollectiveCheck::end(Clock::time_point deadline, bool ok) {
  struct End {  // the collective ends however this returns
    CollectiveCheck& c;
    ~End() {
      c.checks_in_.clear();
      c.checks_out_.clear();
      std::lock_guard<std::mutex> lock(c.mu_);
      c.in_collective_ = false;
    }
  } end{*this};
  if (!ok) return;
  for (auto& c : checks_in_) worker_.wait(*c, deadline);
  for (auto& c : checks_out_) worker_.wait(*c, deadline);
}

void CollectiveCheck::verify_arrived() {
  for (auto& c : checks_in_) {
    if (!c->verified && c->done.load(std::memory_order_acquire)) verify(*c);
  }
}

void CollectiveCheck::verify(Transfer& t) {
  if (t.verified) return;
  if (t.status != UCS_OK && t.status != UCS_ERR_MESSAGE_TRUNCATED) {
    if (worker_.failure_.failed()) worker_.failure_.rethrow();
    throw PeerError("ucx: " + t.what() + " failed: " + ucs_status_string(t.status));
  }
  t.verified = true;
  const Descriptor mine = for_peer(t.peer, false);
  const auto low = static_cast<uint32_t>(t.sender_tag);
  if (low & kFusedBit) {
    const auto theirs = from_fused_tag(low, mine.seq);
    if (!signatures_agree(mine, theirs)) mismatch(t.peer, theirs);
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
  if (!signatures_agree(mine, theirs)) mismatch(t.peer, theirs);
}

void CollectiveCheck::mismatch(int peer, const Descriptor& theirs) {
  const Descriptor mine = for_peer(peer, false);
  worker_.failure_.fail(mismatch_message("ucx", mine, peer, theirs), true);
  // Every rank of the group learns it now, not at its timeout: the others
  // may be waiting for ranks that already gave up.
  worker_.control_.notify_mismatch(mine, peer, theirs);
  worker_.failure_.rethrow();
}

}  // namespace cohort::ucx
