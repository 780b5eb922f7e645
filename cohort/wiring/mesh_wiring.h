// defines: MeshGradientSync and MeshGradNorm, what TrainerWiring::mesh adds
// to a pipeline's wiring for a TP x PP x DP mesh (cohort/mesh), and
// TensorParallelGradNorm, the norm of the wirings that take a model of TP
// layers without a mesh (ddp, all_reduce, fsdp: one Trainer per TP rank).
//
// MeshGradientSync finishes a step's gradients through the mesh's
// GradientSynchronizer (DP average, the sequence-parallel TP all-reduce and
// the tied embedding's all-reduce between the first and last stage).
//
// MeshGradNorm is the norm of the whole model, each parameter once: a
// parameter that the TP layers shard (column- and row-parallel weights, a
// column-parallel bias, a vocabulary-parallel table, what any other
// TensorParallelModule names, an expert's w1, b1 and w2 split over tp,
// tensor_parallel::split_dims) counts on every TP rank
// (each holds its own rows or columns); one replicated over TP (LayerNorms,
// row-parallel biases, position embeddings) counts on TP rank 0 only; the
// last stage's copy of the tied embedding does not count (the first stage's
// does; their gradients are equal after the sync), nor does a copy of a
// weight declared tied (PipelineStage::tie) other than the lowest stage's. The squares are summed
// over the TP group, then over the PP group; the DP replicas hold the same
// gradients and compute the same sum. Under expert parallelism (a mesh "ep"
// dimension above 1) each ep rank holds other experts: their squares are
// summed over the ep group first, while everything else is the same on every
// ep rank after the sync and counts once. The "cp" ranks hold replicas.
//
// TensorParallelGradNorm counts the same way over the TP layers' group: a
// TP-split parameter on every TP rank, a replicated one on TP rank 0 only.
// Its squares are summed over the shard group first where the ranks of the
// data-parallel group hold disjoint parts of each gradient (FSDP's shards),
// then over the TP group; DDP's and the all-reduce's replicas hold whole,
// equal gradients and sum over the TP group alone.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <vector>

#include "cohort/mesh/device_mesh.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/plan/grad_norm.h"
#include "cohort/plan/gradient_sync.h"

namespace cohort {

/// The Trainer's gradient sync over a mesh: GradientSynchronizer::synchronize after the
/// pipeline's step (its gradients bypass the DP reducer's backward hooks).
class MeshGradientSync : public GradientSync {
 public:
  /// `sync` must outlive it.
  explicit MeshGradientSync(GradientSynchronizer& sync) : sync_(sync) {}
  std::shared_ptr<void> skip_sync() override { return nullptr; }
  void finish_sync() override { sync_.synchronize(); }
  /// The failures ride the DP reducer's first all-reduce: none is added.
  void finish_sync_unless_failed(const std::exception_ptr& failed) override {
    sync_.synchronize(failed);
  }
  /// Seconds in the TP, embedding and DP reductions.
  double comm_seconds() const override {
    const auto& s = sync_.stats();
    return s.tp.seconds + s.pp.seconds + s.dp.seconds + s.experts.seconds;
  }

 private:
  GradientSynchronizer& sync_;
};

/// The global gradient norm of a model split over a mesh (file comment).
class MeshGradNorm : public GradNorm {
 public:
  /// `stages`: this rank's stages (their TP layers tell which parameters are sharded);
  /// `tied_copies`: the copies of tied weights that do not count (the last stage's copy
  /// of the tied embedding, the duplicates of the weights PipelineStage::tie declares).
  MeshGradNorm(DeviceMesh mesh, torch::nn::Module& stages,
               const std::vector<torch::Tensor>& tied_copies);
  double global_norm(const std::vector<torch::Tensor>& params) override;

 private:
  bool counts(const torch::Tensor& p) const;

  DeviceMesh mesh_;
  std::map<const void*, int64_t> sharded_;  // TP-split parameters (tensor_parallel::split_dims)
  std::set<const void*> experts_;           // split over "ep" (when it is above 1)
  std::set<const void*> tied_copies_;
};

/// The global gradient norm of a model of TP layers outside a mesh (file comment).
class TensorParallelGradNorm : public GradNorm {
 public:
  /// `model`: its TP layers tell which parameters are split; `tp_group`: their group;
  /// `shard_group`: the group over which each rank holds its own part of every gradient
  /// (FSDP's shard group), or null where every rank holds them whole.
  TensorParallelGradNorm(torch::nn::Module& model, std::shared_ptr<Communicator> tp_group,
                         std::shared_ptr<Communicator> shard_group);
  double global_norm(const std::vector<torch::Tensor>& params) override;

 private:
  std::map<const void*, int64_t> split_;  // tensor_parallel::split_dims
  std::shared_ptr<Communicator> tp_group_, shard_group_;
};

}  // namespace cohort
