// defines: FusedOptions, FusedDistributedOptimizer: data-parallel AdamW that
// reduces the gradients itself, bucket by bucket, and overlaps each bucket's
// all-reduce with the update of the bucket before it:
//
//   launch all-reduce(bucket 0)
//   launch all-reduce(bucket 1); wait(bucket 0); average + AdamW(bucket 0)
//   launch all-reduce(bucket 2); wait(bucket 1); average + AdamW(bucket 1)
//   ...                          wait(last);     average + AdamW(last)
//
// Use it on a plain module (no DDP): backward fills .grad, step() does the
// rest. The parameters become views into one flat buffer per bucket, and
// the AdamW state is flat too, so an update is a handful of kernels per
// bucket (fused_adamw.h) instead of a handful per parameter. Numbers equal
// DDP + torch::optim::AdamW with the same options (to rounding).
//
// A parameter without a gradient on any rank is skipped, as LibTorch's
// AdamW skips an undefined .grad (no decay, no state update); one with a
// gradient on some ranks only counts as zero on the others, as in DDP. At
// world size 1 there is no communication.
#pragma once

#include <torch/optim/adamw.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <memory>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

struct FusedOptions {
  // Largest bucket in MiB (a larger parameter gets a bucket of its own).
  double bucket_cap_mb = 25;
};

class FusedDistributedOptimizer {
 public:
  // Collective: every rank passes the same shapes in the same order, with
  // equal values (broadcast them first, e.g. by building DDP once, or seed).
  FusedDistributedOptimizer(std::vector<torch::Tensor> params, torch::optim::AdamWOptions options,
                            std::shared_ptr<Communicator> comm, FusedOptions fused = {});

  // Collective: average the gradients over the ranks and apply AdamW.
  void step();
  // Releases the gradients (set to none).
  void zero_grad();
  void set_lr(double lr) { options_.lr(lr); }
  torch::optim::AdamWOptions& options() { return options_; }
  // Steps taken so far.
  int64_t timestep() const { return timestep_; }
  size_t bucket_count() const { return buckets_.size(); }
  // Parameter indices of each bucket.
  std::vector<std::vector<size_t>> bucket_layout() const;
  // Bytes of AdamW state and of gradient buffers held between steps.
  int64_t state_bytes() const;
  int64_t grad_bytes() const;

  // Replicated state (every rank holds all of it): rank 0's save suffices.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> offsets;  // of each parameter in the flat buffers
    torch::Tensor param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq;
    Work work;
  };
  void fill(Bucket& b, const std::vector<char>& has);
  void apply(Bucket& b, const std::vector<char>& has);

  std::shared_ptr<Communicator> comm_;
  torch::optim::AdamWOptions options_;
  std::vector<torch::Tensor> params_;
  std::vector<int64_t> steps_;  // per parameter (skipped ones lag behind)
  std::vector<Bucket> buckets_;
  int64_t timestep_ = 0;
};

}  // namespace cohort
