// defines: SyncStrategy, DDPOptions (how DistributedDataParallel buckets and
// reduces gradients).
#pragma once

#include <cstdint>

#include "cohort/compression/compressor.h"
#include "cohort/grad_sync/leaf_tree.h"

namespace cohort {

/// When gradients are all-reduced.
enum class SyncStrategy {
  /// Buckets are launched while backward is still running (the default, as
  /// PyTorch DDP): communication hides behind the rest of backward.
  Overlapped,
  /// Everything is reduced at the end of backward, bucket by bucket: no
  /// overlap; a baseline, and simpler to reason about when debugging.
  Synchronous,
  /// Never reduce in backward: gradients stay local until
  /// GradientReducer::synchronize() is called (manual accumulation schemes).
  NoSync,
};

/// Options of DistributedDataParallel, as PyTorch's DDP constructor arguments.
struct DDPOptions {
  /// Largest bucket, in MiB of gradient data (PyTorch's default).
  double bucket_cap_mb = 25;
  /// The first bucket (last layers' gradients, ready first) is smaller so
  /// that communication starts early in backward.
  double first_bucket_mb = 1;
  /// Re-broadcast buffers (BatchNorm running stats) from rank 0 before each
  /// forward in training, so every rank normalizes with the same statistics.
  bool broadcast_buffers = true;
  /// Parameters that take no part in an iteration's graph are marked ready
  /// (found by walking the autograd graph from the forward outputs), so
  /// buckets holding them still launch. Off: such a parameter is an error
  /// naming it at the next forward.
  bool find_unused_parameters = false;
  /// Parameters' .grad become views into the bucket buffers: no copy in or
  /// out, no second copy of the gradients in memory. On by default, unlike
  /// PyTorch (whose default is off for backward compatibility): on the CPU
  /// the two extra passes over every gradient cost a large share of a step
  /// (docs/benchmarks.md). Off gives .grad tensors of their own, as PyTorch.
  bool gradient_as_bucket_view = true;
  /// When to reduce; no_sync() overrides it for a scope.
  SyncStrategy strategy = SyncStrategy::Overlapped;
  /// Gradient compression (cohort/compression): a kind other than None
  /// registers a CompressionHook built from these options at construction
  /// (register_comm_hook replaces it). Buckets must be float32.
  compression::CompressionOptions compression;
  /// Determinism::WorldSizeInvariant: the global batch is `leaves` leaves;
  /// each rank runs one forward and one backward per leaf it owns
  /// (DistributedDataParallel::local_leaves()), and the backward of its last
  /// leaf sets every .grad to the mean over all leaves, summed in the
  /// canonical tree: the same bits at every world size dividing `leaves`
  /// (cohort/ddp/README.md, "World-size invariant training"). Refuses comm
  /// hooks, compression, no_sync() and a reduction owner.
  Determinism determinism = Determinism::Default;
  /// The leaf count L of the global batch (WorldSizeInvariant only; the
  /// world size must divide it, the same on every rank).
  int64_t leaves = 0;
};

}  // namespace cohort
