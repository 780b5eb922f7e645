// defines: GradBucket, CommHook (a flat bucket in, a Work out) and the
// built-in hooks: AllReduceHook (the default), Fp16CompressHook,
// Bf16CompressHook.
//
// As in PyTorch's register_comm_hook: later compression schemes (PowerSGD,
// top-k) plug in here without touching the reducer.
#pragma once

#include <torch/types.h>

#include <memory>
#include <string>

#include "cohort/comm/communicator.h"
#include "cohort/core/work.h"

namespace cohort {

// One bucket handed to a hook.
struct GradBucket {
  // Position in the launch order (the same on every rank).
  int64_t index = 0;
  // Flat, contiguous gradients of the bucket's parameters (one dtype).
  torch::Tensor buffer;
  // True for the last bucket of the iteration.
  bool is_last = false;
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  // Starts the reduction of bucket.buffer over comm. When the returned Work
  // has been waited on, bucket.buffer must hold the average over ranks.
  // Called once per bucket, buckets in index order on every rank.
  virtual Work run(Communicator& comm, GradBucket& bucket) = 0;
  virtual std::string name() const = 0;
};

// all_reduce(Avg) of the bucket in place.
class AllReduceHook : public CommHook {
 public:
  Work run(Communicator& comm, GradBucket& bucket) override;
  std::string name() const override { return "all_reduce"; }
};

// Casts the bucket to a reduced-precision copy, all-reduces the copy (Sum),
// then casts back and divides by the world size. Note: cohort's Gloo path
// currently reduces float16/bfloat16 in a float32 buffer, so on Gloo these
// hooks save no bandwidth yet; they cost precision only. They pay off once
// an engine sends 16-bit data natively.
class ReducedPrecisionHook : public CommHook {
 public:
  explicit ReducedPrecisionHook(torch::Dtype wire_dtype) : wire_dtype_(wire_dtype) {}
  Work run(Communicator& comm, GradBucket& bucket) override;
  std::string name() const override;

 private:
  torch::Dtype wire_dtype_;
};

class Fp16CompressHook : public ReducedPrecisionHook {
 public:
  Fp16CompressHook() : ReducedPrecisionHook(torch::kFloat16) {}
};

class Bf16CompressHook : public ReducedPrecisionHook {
 public:
  Bf16CompressHook() : ReducedPrecisionHook(torch::kBFloat16) {}
};

}  // namespace cohort
