// defines: DDPStats, what DistributedDataParallel measured about its last
// reduced iteration (and totals since construction, for benchmarks).
#pragma once

#include <cstdint>

namespace cohort {

/// What DDP measured about its gradient reduction (DistributedDataParallel::stats()).
struct DDPStats {
  /// Backward passes whose gradients were reduced (no_sync ones not counted).
  int64_t iterations = 0;
  /// Buckets in the current layout.
  int64_t buckets = 0;
  /// Whether the buckets are in an observed gradient order: false until the
  /// rebuild after the first iteration, and again from a change of the
  /// parameters that require grad to the rebuild after it.
  bool buckets_rebuilt = false;
  /// Bytes handed to the communication hook in the last reduced iteration.
  int64_t bytes = 0;
  /// Bytes this rank sent in the last reduced iteration, as the communicator
  /// counts them at the engine boundary (Communicator::stats): what the hook
  /// really put on the wire (a compressing hook sends fewer than `bytes`).
  int64_t bytes_sent = 0;
  /// Last iteration: seconds from the first gradient ready to the end of
  /// backward (the autograd engine's final callback).
  double backward_seconds = 0;
  /// Last iteration: seconds during which at least one bucket was in flight.
  double comm_seconds = 0;
  /// Last iteration: the part of comm_seconds before backward ended, i.e.
  /// communication hidden behind computation.
  double hidden_comm_seconds = 0;
  /// Last iteration: seconds backward's end waited for the buckets.
  double exposed_wait_seconds = 0;
  /// Last iteration: hidden_comm_seconds / comm_seconds (0 without comm).
  double hidden_comm_share = 0;
  /// Sums over all reduced iterations (benchmarks take the ratio).
  double total_comm_seconds = 0;
  /// Sum of hidden_comm_seconds over all reduced iterations.
  double total_hidden_comm_seconds = 0;
};

}  // namespace cohort
