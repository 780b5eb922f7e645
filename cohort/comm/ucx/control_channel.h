// defines: ControlChannel, the Worker's part that carries notices between
// the ranks of a group on the control channel: a receive that did not fit
// (both ranks fail), collectives that differ (every rank fails), a rank
// that closed (after how many collectives, cleanly or not), and the
// liveness probe a timed-out wait sends (ping, pong).
//
// A notice is a type word and its fields, at most kNoticeWords words. One
// receive is posted at a time, matching any sender; the thread that handles
// a notice posts the next one, which matches any notice already queued.
//
// Locking rule:
// - mu_ is taken with try_lock by whichever thread looks at the notices
//   (a waiter, the engine's thread between jobs): one handles, the others
//   go on. It guards controls_ (every control receive stays alive there
//   until the close) and is held while a notice is handled, which may take
//   GroupFailure's and CollectiveCheck's locks and post sends (UCX's own
//   lock), never the reverse.
// - current_ is read without a lock (it only ever points into controls_).
// - The closure records and the probe's answers are atomics: written by
//   the handler, read by any thread.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/comm/ucx/collective_check.h"
#include "cohort/comm/ucx/transfer.h"
#include "cohort/core/types.h"

namespace cohort::ucx {

class ControlChannel {
 public:
  ControlChannel(Worker& worker, int rank, int size);

  // Posts the receive for the next notice (the first one at the end of the
  // rendezvous). Throws PeerError when UCX refuses it.
  void post_receive();
  // Handles the notices that arrived, unless another thread is.
  void handle();
  // True once the receive posted is not yet cancelled by the close.
  bool open() const { return current_.load(std::memory_order_acquire) != nullptr; }

  // Tells `t`'s sender that its message did not fit (a receive whose
  // message had another size or dtype than its buffer).
  void notify_bad_message(const Transfer& t);
  // Tells every rank that this rank called `mine` and `peer` `theirs`.
  void notify_mismatch(const Signature& mine, int peer, const Signature& theirs);
  // Tells every rank that this one closes after `collectives`, `clean`
  // when nothing failed and no collective was left half done.
  void notify_closed(int64_t collectives, bool clean);

  // How many collectives `peer` ran before it closed (INT64_MAX while open).
  int64_t closed_after(int peer) const {
    return closed_after_[static_cast<size_t>(peer)].load(std::memory_order_acquire);
  }
  // Whether `peer` announced that it closed its communicator cleanly.
  bool closed_cleanly(int peer) const {
    return closed_clean_[static_cast<size_t>(peer)].load(std::memory_order_acquire);
  }
  // The liveness probe: asks every open peer whether it still answers and
  // waits up to `most`; what to add to a timeout's message, naming the
  // peers that did not answer.
  std::string probe(Millis most);

 private:
  static constexpr int kNoticeWords = 3 + 2 * kDescriptorWords;  // two ranks, two descriptors
  enum Notice : int64_t { kBadMessage = 1, kMismatch = 2, kClosed = 3, kPing = 4, kPong = 5 };
  static constexpr int kBadMessageWords = 6;
  void on_notice(const int64_t* w, size_t words);
  void on_bad_message(const int64_t* w);
  void on_mismatch(const int64_t* w);
  void on_closed(int peer, int64_t collectives, bool clean);
  void post_receive_locked();  // mu_ held
  void send(const at::Tensor& notice, int peer);
  void send_all(const at::Tensor& notice);
  // Records that `peer` answered this rank's probe round `round`.
  void answered(int peer, int64_t round);
  // A four-word notice: its type and three fields.
  static at::Tensor notice(Notice type, int64_t a, int64_t b, int64_t c);

  Worker& worker_;
  const int rank_, size_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Transfer>> controls_;  // under mu_
  std::atomic<Transfer*> current_{nullptr};
  std::unique_ptr<std::atomic<int64_t>[]> closed_after_;
  std::unique_ptr<std::atomic<bool>[]> closed_clean_;
  // Per peer, the last probe round it answered; when its last ping came
  // (steady clock, ns); the current round.
  std::unique_ptr<std::atomic<int64_t>[]> answered_;
  std::unique_ptr<std::atomic<int64_t>[]> pinged_at_;
  std::atomic<int64_t> probe_round_{0};
};

}  // namespace cohort::ucx
