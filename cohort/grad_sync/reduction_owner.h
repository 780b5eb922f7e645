// defines: ReductionOwner, the seam through which an optimizer that shards
// the gradients (ZeroRedundancyOptimizer at stage 2) takes over
// DistributedDataParallel's gradient reduction.
//
// DDP keeps everything that is about the model: the parameter check and the
// broadcast at construction, the buffers' broadcast before forward, the
// unused-parameter search, no_sync(), the "a parameter got no gradient"
// check at the end of backward. What it hands over is what becomes of a
// ready gradient: instead of copying it into an all-reduce bucket, DDP tells
// the owner, which reduce-scatters it into the ranks' shards. While an owner
// is set DDP holds no bucket buffers at all (they are freed), so the owner's
// buffers are the only gradient memory besides autograd's own.
#pragma once

#include <torch/types.h>

#include <cstddef>
#include <vector>

namespace cohort {

/// An object DDP hands its gradient reduction to (ZeRO-2): told when each parameter's gradient is
/// ready instead of DDP all-reducing it.
class ReductionOwner {
 public:
  virtual ~ReductionOwner() = default;
  /// In a synchronizing backward (not under no_sync()), once per parameter:
  /// parameter `index` (of GradientReducer::parameters()) holds in .grad its
  /// gradient accumulated over the no_sync() backwards before this one. An
  /// undefined .grad (a parameter unused so far) counts as zeros. Runs on
  /// the autograd thread, in the order gradients become ready.
  virtual void gradient_ready(size_t index) = 0;
  /// Every parameter has been reported (end of backward, or synchronize()).
  virtual void backward_finished() = 0;
  /// GradientReducer::parameters() changed: a parameter's requires_grad
  /// changed since DDP's last forward, and DDP now reduces the parameters
  /// that require grad (the ranks agreed). From now on `index` in
  /// gradient_ready() is of the new list. Called at a forward (or
  /// synchronize()), outside any backward, between iterations.
  virtual void parameters_changed() = 0;
  /// The synchronizing backward that reported gradients since the last
  /// backward_finished() threw (DDP finds it at the next forward, before
  /// any collective of its own): drop what it reported, waiting for what
  /// was launched (launched alike on every rank that threw at that call),
  /// so that the next backward starts a new iteration. DDP drops every
  /// .grad itself. Must not throw.
  virtual void backward_failed() noexcept {}
  /// Whether the owner takes DDP's Determinism::WorldSizeInvariant result as
  /// a chunk (leaf_chunk_ready()); DDP refuses an owner that does not.
  virtual bool takes_leaf_chunks() const { return false; }
  /// WorldSizeInvariant, at the end of the rank's last leaf's backward
  /// instead of gradient_ready()/backward_finished(): `chunk` is this rank's
  /// chunk of the canonical mean (LeafReduction::finish_chunk()) of the
  /// parameters' gradients laid end to end in GradientReducer::parameters()
  /// order, and `used[i]` whether parameter i got a gradient in any leaf on
  /// any rank (the same on every rank). A parameter with `used[i] == 0` has
  /// zeros in the chunk but no gradient: the owner must leave it without one,
  /// as DDP leaves its .grad undefined. No .grad is set.
  virtual void leaf_chunk_ready(torch::Tensor chunk, std::vector<char> used) {
    (void)chunk;
    (void)used;
  }
};

}  // namespace cohort
