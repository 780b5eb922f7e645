// defines: GradientShardReducer, ZeRO stage 2's gradient reduction: it
// stages each ready gradient into its bucket and reduce-scatters every full
// bucket (Avg) into this rank's gradient shard while backward goes on.
//
// It is a ReductionOwner (reduction_owner.h): alone it hooks the parameters'
// gradient accumulators itself; with cohort DDP, DDP reports ready
// gradients to it instead of all-reducing its own buckets.
//
// Memory: each bucket has its own staging buffer, live from the first
// gradient staged into it until its reduce-scatter completes (polled as
// backward goes on). A staged gradient leaves .grad (set to none), so
// autograd's copy is freed at once. At most two buckets are staged at a
// time: the one filling and the one on the wire; a third waits for the
// older one. So a rank's gradient memory during backward is its shard (1/N)
// plus at most two buckets, typically one (staging_peak_bytes() says), not
// the full gradient.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/ddp/accumulator_hooks.h"
#include "cohort/ddp/gradient_reducer.h"
#include "cohort/ddp/reduction_owner.h"
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
  /// (take_over()).
  GradientShardReducer(std::vector<torch::Tensor> params, const FlatPartition& partition,
                       std::shared_ptr<Communicator> comm, bool hook,
                       std::function<std::string(const std::string&)> where);
  /// Gives DDP its reduction back.
  ~GradientShardReducer() override;
  GradientShardReducer(const GradientShardReducer&) = delete;
  GradientShardReducer& operator=(const GradientShardReducer&) = delete;

  /// From now on `ddp` reports ready gradients here (every parameter it
  /// reduces must be one of ours: InvalidArgument otherwise).
  void take_over(GradientReducer& ddp);
  /// Whether a DDP hands its reduction over.
  bool has_ddp() const { return ddp_ != nullptr; }

  /// Stages what backward did not (gradients set by hand or accumulated
  /// under no_sync() only), launches the remaining buckets, waits for all,
  /// releases the staging. Returns, per parameter, whether any rank had a
  /// gradient. Throws Error if a parameter got a second gradient.
  std::vector<char> finish();
  /// Drops an unfinished iteration (waits for what was launched).
  void drop();

  /// This rank's averaged gradients after finish(), in shard order.
  const torch::Tensor& shard() const { return shard_; }
  /// The staging buffers alive now (one per staged bucket).
  std::vector<torch::Tensor> live_staging() const;
  /// Bytes of all buckets' staging buffers (mapped, lazily freed between uses).
  int64_t staging_bytes() const;
  /// The most staging bytes alive at once since construction.
  int64_t staging_peak_bytes() const { return peak_bytes_; }

  /// While positive, backward accumulates in .grad (alone; with DDP use
  /// ddp.no_sync()).
  void push_no_sync() { ++no_sync_depth_; }
  /// Leaves one no_sync scope; the next backward reduces the accumulated gradients.
  void pop_no_sync() { --no_sync_depth_; }

  /// The accumulator hook of parameter i (alone).
  void on_gradient_ready(size_t i);

 private:
  void gradient_ready(size_t ddp_index) override;
  void backward_finished() override;
  void begin_iteration();
  void stage_gradient(size_t i);
  torch::Tensor& staging(size_t b);
  void launch_ready_buckets(bool all);
  // Releases the staging of launched buckets whose reduce-scatter is done;
  // with `block`, waits for the oldest one first.
  void release_finished(bool block);
  void release(size_t b);
  size_t live_staged() const;

  std::vector<torch::Tensor> params_;
  const FlatPartition& partition_;
  std::shared_ptr<Communicator> comm_;
  std::function<std::string(const std::string&)> where_;
  torch::Tensor shard_;

  // Per bucket: its parameters, what it still waits for (parameters that
  // require grad), its staging buffer, the buffer while in use, its Work.
  // Per parameter: its buckets, whether staged and whether it had a
  // gradient here this iteration.
  struct Bucket {
    std::vector<size_t> params;
    int pending_init = 0;
    int pending = 0;
    std::unique_ptr<StagingBuffer> buffer;
    torch::Tensor live;
    Work work;
    bool launched = false;
  };
  std::vector<Bucket> buckets_;
  std::vector<std::vector<size_t>> param_buckets_;
  std::vector<char> staged_, has_;
  std::vector<size_t> in_flight_;  // launched, staging not yet released
  bool active_ = false;            // an iteration is under way
  int64_t next_launch_ = -1;       // launched from the last bucket down
  bool twice_ = false;
  int no_sync_depth_ = 0;
  int64_t live_bytes_ = 0;
  int64_t peak_bytes_ = 0;

  std::unique_ptr<AccumulatorHooks> hooks_;  // alone
  GradientReducer* ddp_ = nullptr;           // with DDP
  std::vector<size_t> from_ddp_;             // DDP's parameter index -> ours
};

/// Collective over comm: per entry, whether any rank's `local` is nonzero.
std::vector<char> any_rank_has(Communicator& comm, const std::vector<char>& local);

}  // namespace cohort
