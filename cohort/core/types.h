// defines: ReduceOp, Millis, CommunicatorOptions, the per-operation option
// structs.
//
// One options struct per operation (Gloo's and c10d's habit): adding a field
// later does not break callers, and defaults live in one place.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/core/algorithm.h"

namespace cohort {

using Millis = std::chrono::milliseconds;

// "Use the communicator's timeout" (set at init; COHORT_TIMEOUT, 30 min by
// default as in PyTorch).
inline constexpr Millis kDefaultTimeout{-1};

enum class ReduceOp { Sum, Avg, Min, Max, Prod };

std::string to_string(ReduceOp op);

// What a Communicator is built with (connect() and init() fill it; the
// algorithms' Executor reads its own fields from it too).
struct CommunicatorOptions {
  // Timeout of every operation that does not set its own.
  Millis timeout{std::chrono::minutes(30)};
  // Check across ranks, before every collective, that all called the same
  // operation with the same shapes and dtypes (COHORT_DEBUG=detail).
  bool debug_checks = false;
  // Named in error messages.
  std::string name = "world";
  // How all_reduce, reduce_scatter and all_gather run when an operation
  // does not choose (cohort/core/algorithm.h). Default means Engine
  // (init() reads COHORT_ALGO; connect() reads no environment).
  Algorithm algorithm = Algorithm::Default;
  // This rank's node, for the hierarchical algorithm (empty: COHORT_NODE_ID,
  // GROUP_RANK or the host name).
  std::string node;
  // Adaptive calibrates sizes up to this many bytes and extrapolates above
  // (0: 64 MiB; init() reads COHORT_CALIBRATION_MAX_BYTES). A job whose
  // collectives are small can cut its start-up time with it.
  int64_t calibration_max_bytes = 0;
};

struct AllReduceOptions {
  ReduceOp op = ReduceOp::Sum;
  Millis timeout = kDefaultTimeout;
  // Default: the communicator's (CommunicatorOptions::algorithm).
  Algorithm algo = Algorithm::Default;
};

struct BroadcastOptions {
  int root = 0;
  Millis timeout = kDefaultTimeout;
};

struct ReduceOptions {
  int root = 0;
  ReduceOp op = ReduceOp::Sum;
  Millis timeout = kDefaultTimeout;
};

struct AllGatherOptions {
  Millis timeout = kDefaultTimeout;
  Algorithm algo = Algorithm::Default;
};

struct ReduceScatterOptions {
  ReduceOp op = ReduceOp::Sum;
  Millis timeout = kDefaultTimeout;
  Algorithm algo = Algorithm::Default;
};

struct GatherOptions {
  int root = 0;
  Millis timeout = kDefaultTimeout;
};

struct ScatterOptions {
  int root = 0;
  Millis timeout = kDefaultTimeout;
};

struct AllToAllOptions {
  Millis timeout = kDefaultTimeout;
};

struct BarrierOptions {
  Millis timeout = kDefaultTimeout;
};

// Point-to-point: a message matches a receive with the same (peer, tag).
// Messages with one (peer, tag) arrive in the order they were sent.
struct SendOptions {
  int tag = 0;
  Millis timeout = kDefaultTimeout;
};

struct RecvOptions {
  int tag = 0;
  Millis timeout = kDefaultTimeout;
};

}  // namespace cohort
