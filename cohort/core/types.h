// defines: ReduceOp, Millis, CommunicatorOptions, the per-operation option
// structs.
//
// One options struct per operation (Gloo's and c10d's habit): adding a field
// later does not break callers, and defaults live in one place.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/core/algorithm.h"

namespace cohort {

using Millis = std::chrono::milliseconds;

/// "Use the communicator's timeout" (set at init; COHORT_TIMEOUT, 30 min by
/// default as in PyTorch).
inline constexpr Millis kDefaultTimeout{-1};

/// How a reduction combines the ranks' values (Avg: the sum over the ranks divided by their
/// number).
enum class ReduceOp { Sum, Avg, Min, Max, Prod };

/// The operation's name, e.g. "sum".
std::string to_string(ReduceOp op);

/// Events a rank's timeline keeps when CommunicatorOptions::trace_max_events
/// is 0 (a few hundred bytes each in memory: at most a few hundred MB per
/// rank). Here, not with the Tracer, because the options name it.
inline constexpr size_t kDefaultTraceMaxEvents = 1000000;

/// What a Communicator is built with (connect() and init() fill it; the
/// algorithms' Executor reads its own fields from it too).
struct CommunicatorOptions {
  /// Timeout of every operation that does not set its own.
  Millis timeout{std::chrono::minutes(30)};
  /// Check across ranks, before every collective, that all called the same
  /// operation with the same shapes and dtypes (COHORT_DEBUG=detail).
  bool debug_checks = false;
  /// Named in error messages.
  std::string name = "world";
  /// How all_reduce, reduce_scatter and all_gather run when an operation
  /// does not choose (cohort/core/algorithm.h). Default means Engine
  /// (init() reads COHORT_ALGO; connect() reads no environment).
  Algorithm algorithm = Algorithm::Default;
  /// This rank's node, for the hierarchical algorithm (empty: COHORT_NODE_ID,
  /// GROUP_RANK or the host name).
  std::string node;
  /// Adaptive calibrates sizes up to this many bytes and extrapolates above
  /// (0: 64 MiB; init() reads COHORT_CALIBRATION_MAX_BYTES). A job whose
  /// collectives are small can cut its start-up time with it.
  int64_t calibration_max_bytes = 0;
  /// Non-empty: this rank writes its timeline to `trace_dir/rank-R.json`
  /// (cohort/observability/README.md; init() reads COHORT_TRACE). Subgroups share
  /// their parent's trace.
  std::string trace_dir;
  /// The most events the trace keeps per rank; later ones are dropped and
  /// counted in the file (0: kDefaultTraceMaxEvents, one million; init()
  /// reads COHORT_TRACE_MAX_EVENTS).
  int64_t trace_max_events = 0;
};

/// Options of Communicator::all_reduce.
struct AllReduceOptions {
  /// How the ranks' values combine.
  ReduceOp op = ReduceOp::Sum;
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
  /// Default: the communicator's (CommunicatorOptions::algorithm).
  Algorithm algo = Algorithm::Default;
};

/// Options of Communicator::broadcast.
struct BroadcastOptions {
  /// The rank that sends (broadcast, scatter) or receives (reduce, gather).
  int root = 0;
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
};

/// Options of Communicator::reduce.
struct ReduceOptions {
  /// The rank that sends (broadcast, scatter) or receives (reduce, gather).
  int root = 0;
  /// How the ranks' values combine.
  ReduceOp op = ReduceOp::Sum;
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
};

/// Options of Communicator::all_gather and all_gather_into_tensor.
struct AllGatherOptions {
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
  /// Default: the communicator's (CommunicatorOptions::algorithm).
  Algorithm algo = Algorithm::Default;
};

/// Options of Communicator::reduce_scatter and reduce_scatter_tensor.
struct ReduceScatterOptions {
  /// How the ranks' values combine.
  ReduceOp op = ReduceOp::Sum;
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
  /// Default: the communicator's (CommunicatorOptions::algorithm).
  Algorithm algo = Algorithm::Default;
};

/// Options of Communicator::gather.
struct GatherOptions {
  /// The rank that sends (broadcast, scatter) or receives (reduce, gather).
  int root = 0;
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
};

/// Options of Communicator::scatter.
struct ScatterOptions {
  /// The rank that sends (broadcast, scatter) or receives (reduce, gather).
  int root = 0;
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
};

/// Options of Communicator::all_to_all and all_to_all_single.
struct AllToAllOptions {
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
};

/// Options of Communicator::barrier.
struct BarrierOptions {
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
};

/// Point-to-point: a message matches a receive with the same (peer, tag).
/// Messages with one (peer, tag) arrive in the order they were sent.
struct SendOptions {
  /// Matches a send with the receive of the same (peer, tag).
  int tag = 0;
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
};

/// Options of Communicator::recv.
struct RecvOptions {
  /// Matches a send with the receive of the same (peer, tag).
  int tag = 0;
  /// The operation's timeout (kDefaultTimeout: the communicator's).
  Millis timeout = kDefaultTimeout;
};

}  // namespace cohort
