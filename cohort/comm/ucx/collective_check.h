// defines: CollectiveCheck, the Worker's part that runs each collective's
// check, and the check's encodings on the wire: the words of a check
// message, and the tag of a small all-reduce message that is its own check.
// Whether two signatures agree and how a difference is worded is the one
// collective checker's (cohort/core/signature.h), shared with every engine
// and with debug mode's store check.
//
// Every collective starts with a check: each rank sends its Signature to
// every other rank and receives every other rank's, so each rank compares
// all of them itself and none can finish a collective that another rank
// called differently. Check messages carry a tag of their own (kCheckBit)
// and are received whatever the rest of their tag, so a rank running another
// kind of collective, with other step tags, still meets its peers' checks,
// and the difference is named at once instead of at the timeout.
//
// Locking rule:
// - The thread that runs the collective alone calls begin, post,
//   post_receive, verify, verify_arrived, active and end, and alone touches
//   the check transfers and an all_to_all's counts (no lock).
// - mu_ guards the current collective (current_, in_collective_,
//   collectives_), which other threads read to word their errors (a
//   notice's handler, a failed point-to-point wait, the close). It is held
//   only to copy them, never across a call out.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cohort/comm/ucx/transfer.h"
#include "cohort/core/signature.h"

namespace cohort::ucx {

using Kind = CollectiveKind;
using Descriptor = Signature;

// A check message: the signature as words (few: a notice carries two, and
// a message that fits in a shared-memory FIFO entry (about 100 bytes) is
// delivered even when its sender closes at once).
inline constexpr int kDescriptorWords = kSignatureWords;

// The low 32 bits of a check message's tag (the engine's step tags are
// non-negative ints, so they never have bit 31).
inline constexpr uint32_t kCheckBit = 1u << 31;
// Set when the message is the collective's data and the tag holds the
// whole descriptor (fused_tag), else the payload holds the words.
inline constexpr uint32_t kFusedBit = 1u << 30;

// The tag of a message that is both a small all-reduce's data and its
// check: dtype, op and size fit in the 30 bits below kFusedBit. Empty when
// they do not (then the collective sends a separate check).
std::optional<uint32_t> fused_tag(const Descriptor& d);
// The descriptor a fused tag stands for, as the seq-th collective.
Descriptor from_fused_tag(uint32_t tag, int64_t seq);

class CollectiveCheck {
 public:
  CollectiveCheck(Worker& worker, int rank, int size) : worker_(worker), rank_(rank), size_(size) {}

  // The collective this rank runs next. An all_to_all gives the elements it
  // sends to and expects from each peer (d.count is then per peer). Fails
  // the group when a peer closed after fewer collectives.
  void begin(const Descriptor& d, std::vector<int64_t> send_counts,
             std::vector<int64_t> recv_counts);
  // Sends this rank's descriptor to every other rank, receives theirs.
  void post();
  // A receive in the check slot from `peer` into `t` (at least a check
  // message long): a fused message.
  std::shared_ptr<Transfer> post_receive(at::Tensor t, int peer);
  // The check of the current collective, compared once it arrived
  // (MismatchError naming both collectives when it differs).
  void verify(Transfer& t);
  // Compares the checks that arrived and are not compared yet.
  void verify_arrived();
  // Whether the current collective has checks to wait for.
  bool active() const { return !checks_in_.empty(); }
  // Waits for the checks and ends the collective; `ok` false (a failed
  // collective) only ends it.
  void end(Clock::time_point deadline, bool ok);

  // "collective #3 (this rank called all_reduce (...))", or "" between
  // collectives.
  std::string current() const;
  // The error when this rank is inside a collective `peer` never ran (it
  // closed after `collectives`), else "".
  std::string outlived(int peer, int64_t collectives) const;
  // How many collectives this rank began; whether one is under way.
  int64_t begun() const;
  bool inside() const;

 private:
  std::string current_locked() const;
  // This rank's descriptor as sent to `peer`, or as expected from it
  // (they differ only in an all_to_all's count).
  Descriptor for_peer(int peer, bool sent);
  // Fails the group naming both collectives, tells every peer, throws.
  [[noreturn]] void mismatch(int peer, const Descriptor& theirs);

  Worker& worker_;
  const int rank_, size_;
  mutable std::mutex mu_;
  Descriptor current_;          // under mu_
  bool in_collective_ = false;  // under mu_
  int64_t collectives_ = 0;     // under mu_: begun by this rank
  std::vector<std::shared_ptr<Transfer>> checks_in_, checks_out_;
  std::vector<int64_t> send_counts_, recv_counts_;
};

}  // namespace cohort::ucx
