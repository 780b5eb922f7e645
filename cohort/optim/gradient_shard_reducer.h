// defines: GradientShardReducer, ZeRO stage 2's gradient reduction: it
// stages each ready gradient into its bucket and reduce-scatters every full
// bucket (Avg) into this rank's gradient shard while backward goes on.
//
// It is a ReductionOwner (reduction_owner.h): alone it hooks the parameters'
// gradient accumulators itself; with cohort DDP, DDP reports ready
// gradients to it instead of all-reducing its own buckets, and it hooks
// only its parameters DDP does not reduce (frozen at DDP's last forward).
//
// Memory: buckets are reduced one after the other, from the last down (the
// order backward fills them; grad_sync's BucketQueue launches and waits).
// Only the current bucket (the queue's next) stages: a gradient
// that lies (partly) in a later bucket, out of order or straddling a bucket
// boundary, stays in its .grad until that bucket is current. Each bucket
// has its own staging buffer, live from the first gradient staged into it
// until its reduce-scatter completes. With `max_staged` 1, a bucket starts
// staging only once the previous one's reduce-scatter is done, so a rank's
// gradient memory during backward is its shard (1/N) plus one bucket; with
// 2 the next bucket fills while the previous one is on the wire (its
// reduction overlaps the rest of backward) at the cost of a second bucket.
// staging_peak_bytes() measures it; held_peak_bytes() the gradients kept
// in .grad waiting for their bucket.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/grad_sync/accumulator_hooks.h"
#include "cohort/grad_sync/bucket_queue.h"
#include "cohort/grad_sync/gradient_reducer.h"
#include "cohort/grad_sync/reduction_owner.h"
#include "cohort/optim/flat_partition.h"
#include "cohort/optim/staging_buffer.h"

namespace cohort {

/// ZeRO stage 2's reduce-scatter of the gradients into this rank's shard,
/// bucket by bucket during backward (see the file comment).
class GradientShardReducer : private ReductionOwner {
 public:
  /// `params` in flat order, laid out by `partition`; `where(op)` names the
  /// owner, rank and group in error messages. Alone (`hook` true) it hooks
  /// the gradient accumulators; otherwise a DDP hands its reduction over
  /// (take_over()). `max_staged` (1 or 2): buckets whose staging may be
  /// alive at once (see the file comment).
  GradientShardReducer(std::vector<torch::Tensor> params, const FlatPartition& partition,
                       std::shared_ptr<Communicator> comm, bool hook,
                       std::function<std::string(const std::string&)> where, int max_staged = 1);
  /// Gives DDP its reduction back.
  ~GradientShardReducer() override;
  GradientShardReducer(const GradientShardReducer&) = delete;
  GradientShardReducer& operator=(const GradientShardReducer&) = delete;

  /// From now on `ddp` reports ready gradients here (every parameter it
  /// reduces must be one of ours: InvalidArgument otherwise, here or at the
  /// forward where it takes one up). Ours that it
  /// does not reduce (frozen at its last forward) are hooked here, and
  /// follow its no_sync(); when its parameters change, so do these.
  void take_over(GradientReducer& ddp);
  /// Whether a DDP hands its reduction over.
  bool has_ddp() const { return ddp_ != nullptr; }

  /// Stages what backward did not (gradients set by hand or accumulated
  /// under no_sync() only), launches the remaining buckets, waits for all,
  /// releases the staging. Returns, per parameter, whether any rank had a
  /// gradient. Throws InvalidArgument on every rank when a rank passes a
  /// `refusal` (the reason it cannot step, as any_rank_has_unless_refused;
  /// `op` names the call that finishes), staged a gradient whose size no
  /// longer fits its parameter (zeros were staged in its place) or had a
  /// parameter's second gradient (a second backward before the step).
  /// Either way the iteration is over; a .grad left is the caller's to drop.
  std::vector<char> finish(const std::string& refusal = "", const std::string& op = "step");
  /// Drops an unfinished iteration (waits for what was launched).
  void drop();

  /// This rank's averaged gradients after finish(), in shard order.
  const torch::Tensor& shard() const { return shard_; }
  /// The staging buffers alive now (one per staged bucket).
  std::vector<torch::Tensor> live_staging() const;
  /// Bytes of all buckets' staging buffers (mapped, lazily freed between uses).
  int64_t staging_bytes() const;
  /// The most staging bytes alive at once since construction.
  int64_t staging_peak_bytes() const { return staging_.peak; }
  /// The most bytes of .grad kept at once waiting for their bucket.
  int64_t held_peak_bytes() const { return held_.peak; }

  /// While positive, backward accumulates in .grad (alone; with DDP use
  /// ddp.no_sync()).
  void push_no_sync() { ++no_sync_depth_; }
  /// Leaves one no_sync scope; the next backward reduces the accumulated gradients.
  void pop_no_sync() { --no_sync_depth_; }

  /// The accumulator hook of parameter i (alone).
  void on_gradient_ready(size_t i);
  /// The accumulator hook of parameter i, with DDP, when DDP does not
  /// reduce it.
  void on_gradient_ready_outside_ddp(size_t i);

 private:
  void gradient_ready(size_t ddp_index) override;
  void parameters_changed() override;
  // from_ddp_, outside_ddp_ and their hooks for DDP's parameters now; the
  // name of the first of DDP's that is not ours ("" if none).
  std::string map_ddp_parameters();
  void backward_finished() override;
  void backward_failed() noexcept override;
  void begin_iteration();
  // Counts each bucket's parts: its parameters that require grad now.
  void count_parts();
  // Parameter i's gradient is in: staged into the current bucket if it lies
  // there, kept in .grad for later buckets.
  void arrive(size_t i);
  // Makes bucket b's staging live (waiting for the buckets on the wire as
  // max_staged_ says) and stages the gradients that arrived for it so far.
  void open_bucket(size_t b);
  // Copies parameter i's part of bucket b (its k-th parameter) into b's
  // staging; .grad goes once every part of i is staged.
  void stage_part(size_t b, size_t k);
  // Launches, from the last bucket down, those whose gradients are all in
  // (`all`: every bucket left).
  void launch_ready_buckets(bool all);
  // Bucket b's reduce-scatter into the shard (the bucket is open).
  Work reduce_scatter(size_t b);
  // Stages what backward did not hand over and launches every bucket left.
  void launch_rest();
  // Releases the staging of launched buckets whose reduce-scatter is done.
  void release_finished();
  void release(size_t b);

  std::vector<torch::Tensor> params_;
  const FlatPartition& partition_;
  std::shared_ptr<Communicator> comm_;
  std::function<std::string(const std::string&)> where_;
  size_t max_staged_;
  torch::Tensor shard_;

  // Per bucket: its parameters (and, per iteration, which of their parts
  // are staged), its staging buffer, the buffer while in use. Its launch
  // and wait are queue_'s, which waits for its parameters that require grad.
  struct Bucket {
    std::vector<size_t> params;
    std::vector<char> staged;
    std::unique_ptr<StagingBuffer> buffer;
    torch::Tensor live;
  };
  std::vector<Bucket> buckets_;
  BucketQueue queue_;  // from the last bucket down
  // Per parameter: (bucket, index in the bucket's params) of each bucket it
  // lies in; whether its gradient arrived this iteration, whether it had
  // one here, how many of its parts are not staged yet.
  std::vector<std::vector<std::pair<size_t, size_t>>> param_buckets_;
  std::vector<char> arrived_, has_;
  std::vector<char> waited_;  // requires_grad when the buckets' parts were counted
  std::vector<size_t> parts_left_;
  std::vector<int64_t> held_grad_;  // bytes of a .grad kept for a later bucket
  bool active_ = false;             // an iteration is under way
  bool twice_ = false;
  std::string misfit_;  // a gradient that did not fit its parameter's place
  int no_sync_depth_ = 0;
  // Bytes alive now, and the most at once so far.
  struct Gauge {
    int64_t now = 0, peak = 0;
    void add(int64_t n) {
      now += n;
      peak = std::max(peak, now);
    }
  };
  Gauge staging_;  // live staging buffers
  Gauge held_;     // .grad kept for a later bucket

  std::unique_ptr<AccumulatorHooks> hooks_;  // alone
  GradientReducer* ddp_ = nullptr;           // with DDP
  static constexpr size_t kNotOurs = static_cast<size_t>(-1);
  std::vector<size_t> from_ddp_;  // DDP's parameter index -> ours (or kNotOurs)
  // With DDP: ours that DDP does not reduce (frozen at its last forward),
  // and their hooks (by index into outside_ddp_).
  std::vector<size_t> outside_ddp_;
  std::unique_ptr<AccumulatorHooks> outside_hooks_;
};

}  // namespace cohort
