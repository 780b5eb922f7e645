// defines: OpKind, OpStats, CommStats: what Communicator::stats() returns,
// per operation kind: calls, bytes that moved, time in flight and time the
// caller spent blocked in wait().
//
// What "bytes" means. Bytes are counted where the communicator meets its
// engine (cohort/observability/counting_engine.h), per rank:
// - cohort's own algorithms (cohort/algorithms: ring, tree, halving-doubling,
//   hierarchical) run over the engine's send/recv, and those are counted
//   exactly: the bytes of every tensor sent and received.
// - an engine's own collectives (Gloo's, Open MPI's) cannot be observed from
//   outside, so they are counted by the closed form of the bandwidth-optimal
//   algorithm, which is what Gloo runs: all_reduce of n bytes at world p is a
//   ring, 2(p-1)n/p sent and received; all_gather of m bytes per rank sends
//   and receives (p-1)m; broadcast and reduce are binomial trees (a rank
//   moves n bytes per child and n to or from its parent); gather, scatter and
//   all_to_all move exactly the blocks that leave or reach the rank; barrier
//   moves nothing. Open MPI may pick other algorithms: its figures are the
//   same model.
// Nothing moves at world 1 or for empty tensors: those calls count 0 bytes.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace cohort {

/// The kinds of operation a Communicator counts, one per public operation,
/// plus Calibration (the traffic adaptive's cost model measures on first
/// use) and Other (engine traffic outside any operation).
enum class OpKind : uint8_t {
  AllReduce,
  AllReduceCoalesced,
  Broadcast,
  BroadcastCoalesced,
  Reduce,
  AllGather,
  AllGatherIntoTensor,
  ReduceScatter,
  ReduceScatterTensor,
  Gather,
  Scatter,
  AllToAll,
  AllToAllSingle,
  Barrier,
  Send,
  Recv,
  Calibration,
  Other,
};

/// Number of OpKind values.
inline constexpr size_t kOpKindCount = static_cast<size_t>(OpKind::Other) + 1;

/// The operation's name as the Communicator spells it ("all_reduce", ...).
const char* to_string(OpKind kind);

/// The kind named `op` (a Communicator operation name); Other if none.
OpKind op_kind_from_name(const std::string& op);

/// Counters of one operation kind on one rank.
struct OpStats {
  uint64_t calls = 0;           ///< operations issued
  uint64_t completed = 0;       ///< of those, seen complete (wait or is_completed)
  uint64_t bytes_sent = 0;      ///< bytes this rank sent (see the file comment)
  uint64_t bytes_received = 0;  ///< bytes this rank received
  /// Sum over completed operations of the time from issue until the caller
  /// saw it complete (wait() returned or is_completed() turned true).
  double seconds_in_flight = 0;
  /// Time the caller spent blocked inside Work::wait().
  double seconds_waiting = 0;

  /// Adds `other`'s counters to these.
  OpStats& operator+=(const OpStats& other);
};

/// A snapshot of a Communicator's counters (Communicator::stats()).
struct CommStats {
  std::array<OpStats, kOpKindCount> ops{};  ///< indexed by OpKind
  uint64_t resets = 0;                      ///< reset_stats() calls before this snapshot
  /// Bytes this rank sent since the Communicator was made, reset_stats() or
  /// not (in a since() result: between the two snapshots, also across a
  /// reset). What code that measures its own interval subtracts: the
  /// per-kind counters go back to zero when anyone resets them.
  uint64_t bytes_sent_ever = 0;

  /// The counters of one kind.
  const OpStats& operator[](OpKind kind) const { return ops[static_cast<size_t>(kind)]; }
  /// Every kind added up.
  OpStats total() const;
  /// Counters of `*this` minus `earlier` (a snapshot taken before). Where
  /// the counters were reset in between, *this: what was counted since the
  /// reset (what came before it is no longer known), but for
  /// bytes_sent_ever.
  CommStats since(const CommStats& earlier) const;
  /// One line per kind that was called: "all_reduce calls=... sent=...".
  std::string to_string() const;
};

}  // namespace cohort
