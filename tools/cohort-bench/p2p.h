// cohort-bench p2p: point-to-point latency, a ping-pong of one tensor
// between ranks 0 and 1 (the other ranks idle):
//
//   cohortrun -n 2 -- cohort-bench p2p --bytes 1024,16777216 --json
//
// Rank 0 sends then receives, rank 1 receives then sends; each round trip
// is timed on rank 0 and half of it is one message's one-way time
// (--early-recv-ms: the time in a receive's wait() posted before a
// computation of that length instead). A row gives the 10th, 50th and 90th percentile over the
// round trips: on a shared host a few percent of operations stall for milliseconds, which moves a
// mean far more than these.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cohort::bench {

struct PingPongConfig {
  std::string backend;         // empty: COHORT_BACKEND or gloo
  std::vector<int64_t> bytes;  // one row each
  int iters = 0;               // round trips a row; 0: ~256 MiB each way, 20..2000
  int warmup = 20;
  int early_recv_ms = 0;  // > 0: time wait() of a receive posted this long before
  bool json = false;
};

int run_ping_pong(const PingPongConfig& cfg);

}  // namespace cohort::bench
