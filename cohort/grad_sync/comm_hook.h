// defines: GradBucket, CommHook (a flat bucket in, a Work out) and the
// built-in hooks: AllReduceHook (the default), Fp16CompressHook,
// Bf16CompressHook, CompressionHook (any cohort/compression compressor).
//
// As in PyTorch's register_comm_hook: later compression schemes (PowerSGD,
// top-k) plug in here without touching the reducer.
#pragma once

#include <torch/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/compression/compressor.h"
#include "cohort/core/work.h"

namespace cohort {

class SerialWorker;

/// One bucket handed to a hook.
struct GradBucket {
  /// Position in the launch order (the same on every rank).
  int64_t index = 0;
  /// Flat, contiguous gradients of the bucket's parameters (one dtype).
  torch::Tensor buffer;
  /// True for the last bucket of the iteration.
  bool is_last = false;
  /// Views of `buffer` shaped as the bucket's parameters (PyTorch's
  /// bucket.gradients()); PowerSGD compresses the matrices among them.
  std::vector<torch::Tensor> gradients;
  /// The elements of `buffer` of parameters this rank did not use in the
  /// step (zeros, or a .grad left from before): a hook that keeps state
  /// holds theirs for left_out().
  std::vector<compression::ElementRange> unused;
};

/// How DDP reduces a bucket of gradients (PyTorch's communication hooks): all-reduce by default, or
/// in reduced precision.
class CommHook {
 public:
  virtual ~CommHook() = default;
  /// Starts the reduction of bucket.buffer over comm. When the returned Work
  /// has been waited on, bucket.buffer must hold the average over ranks.
  /// Called once per bucket, buckets in index order on every rank.
  virtual Work run(Communicator& comm, GradBucket& bucket) = 0;
  /// The hook's name, for logs and benchmarks.
  virtual std::string name() const = 0;
  /// True when the hook keeps state across iterations that a resumed run
  /// needs (error feedback, PowerSGD's Q): the Trainer then saves each rank's
  /// state() in the checkpoint. The same on every rank.
  virtual bool stateful() const { return false; }
  /// This rank's state, as named tensors (copies).
  virtual std::map<std::string, torch::Tensor> state() const { return {}; }
  /// Restores state() saved by the same rank of an earlier run.
  virtual void load_state(const std::map<std::string, torch::Tensor>& state) { (void)state; }
  /// The buckets at `indices` now hold other parameters (DDP rebuilt its
  /// buckets): state kept for them describes the old contents and must not
  /// be applied to the new. Called on every rank, between iterations.
  virtual void buckets_changed(const std::vector<int64_t>& indices) { (void)indices; }
  /// After bucket `index` was reduced: no rank used the parameters at
  /// `ranges` (some of its GradBucket::unused), so DDP drops the step's
  /// result for them; a hook that keeps state puts theirs back as it was
  /// before the step. Called on every rank with the same ranges.
  virtual void left_out(const Communicator& comm, int64_t index,
                        const std::vector<compression::ElementRange>& ranges) {
    (void)comm, (void)index, (void)ranges;
  }
};

/// all_reduce(Avg) of the bucket in place.
class AllReduceHook : public CommHook {
 public:
  Work run(Communicator& comm, GradBucket& bucket) override;
  std::string name() const override { return "all_reduce"; }
};

/// Averages the bucket sending float16 or bfloat16 on the wire: a ring
/// reduce-scatter with 16-bit messages and float32 sums at each hop, then a
/// ring all-gather (compression::low_precision_all_reduce), over the
/// communicator's point-to-point, so every engine sends half the bytes of a
/// float32 all-reduce. Runs on the hook's worker thread (cohort/core/serial_worker.h): the
/// Work returned completes there, while backward goes on.
class ReducedPrecisionHook : public CommHook {
 public:
  /// Sends the gradients as `wire_dtype` (f16 or bf16).
  explicit ReducedPrecisionHook(torch::Dtype wire_dtype) : wire_dtype_(wire_dtype) {}
  Work run(Communicator& comm, GradBucket& bucket) override;
  std::string name() const override;

 private:
  torch::Dtype wire_dtype_;
  std::shared_ptr<SerialWorker> worker_;  // started at the first bucket
};

/// ReducedPrecisionHook with f16 on the wire.
class Fp16CompressHook : public ReducedPrecisionHook {
 public:
  Fp16CompressHook() : ReducedPrecisionHook(torch::kFloat16) {}
};

/// ReducedPrecisionHook with bf16 on the wire.
class Bf16CompressHook : public ReducedPrecisionHook {
 public:
  Bf16CompressHook() : ReducedPrecisionHook(torch::kBFloat16) {}
};

/// Reduces each bucket with a cohort/compression compressor (DDPOptions::compression builds one).
// Averages each bucket with a compressor (cohort/compression/compressor.h),
// keyed by the bucket's index; what it keeps (error feedback, PowerSGD's Q)
// is reachable through compressor() for checkpoints. Runs on the hook's
// worker thread (cohort/core/serial_worker.h), as ReducedPrecisionHook; state() and
// load_state() first wait for it. A float32 bucket is required.
class CompressionHook : public CommHook {
 public:
  /// Builds its compressor with compression::make_compressor(options).
  explicit CompressionHook(const compression::CompressionOptions& options)
      : compressor_(compression::make_compressor(options)) {}
  /// Uses `compressor`, which may be shared with the caller (to inspect its state).
  explicit CompressionHook(std::shared_ptr<compression::Compressor> compressor)
      : compressor_(std::move(compressor)) {}
  Work run(Communicator& comm, GradBucket& bucket) override;
  std::string name() const override { return compressor_->name() + "_compress"; }
  /// The compressor that reduces the buckets.
  compression::Compressor& compressor() { return *compressor_; }
  bool stateful() const override { return true; }
  std::map<std::string, torch::Tensor> state() const override;
  void load_state(const std::map<std::string, torch::Tensor>& state) override;
  /// Resets the compressor's state of those buckets (Compressor::reset).
  void buckets_changed(const std::vector<int64_t>& indices) override;
  /// Puts back the compressor's error feedback of those ranges
  /// (Compressor::put_back).
  void left_out(const Communicator& comm, int64_t index,
                const std::vector<compression::ElementRange>& ranges) override;

 private:
  std::shared_ptr<compression::Compressor> compressor_;
  std::shared_ptr<SerialWorker> worker_;  // started at the first bucket
};

}  // namespace cohort
