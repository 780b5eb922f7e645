// defines: ReduceOp, Millis, the per-operation option structs.
//
// One options struct per operation (Gloo's and c10d's habit): adding a field
// later does not break callers, and defaults live in one place.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "cohort/algorithms/algorithm.h"

namespace cohort {

using Millis = std::chrono::milliseconds;

// "Use the communicator's timeout" (set at init; COHORT_TIMEOUT, 30 min by
// default as in PyTorch).
inline constexpr Millis kDefaultTimeout{-1};

enum class ReduceOp { Sum, Avg, Min, Max, Prod };

std::string to_string(ReduceOp op);

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
