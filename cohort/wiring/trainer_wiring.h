// defines: TrainerWiring, the factories of a Trainer's TrainingPlan
// (cohort/plan/training_plan.h: its communicator, the model whose
// parameters get the gradients, the optimizer adapter, the gradient sync,
// the TrainerLayout and the state dict), one per valid pairing of data
// parallelism and optimizer (ddp, zero, fused, all_reduce, pipeline, mesh,
// fsdp; each documented below). Each puts together the parts its mode's
// folder exports and the mode's state dict (cohort/dcp/state_dict), so this
// module sits above every mode, and the Trainer, which takes the plan,
// below. A pairing outside the list has no factory and does not compile;
// the one rule the types cannot say (the ZeRO of ddp(ddp, zero) was built
// from that DDP) is checked when the wiring is made, as InvalidArgument.
//
// The plan owns the adapters; the DDP, the optimizers, the pipeline
// runtime and the model are the caller's and must outlive the Trainer.
// How each wiring clips, checkpoints and reports: cohort/train/README.md.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/trainer_adapters.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/plan/training_plan.h"

namespace cohort {

/// A TrainingPlan made by one factory per valid pairing (see the file comment); the Trainer
/// takes it as its TrainingPlan.
class TrainerWiring : public TrainingPlan {
 public:
  /// DDP + any LibTorch optimizer (DDP averages in backward, no_sync() between micro-batches).
  template <typename ModuleHolder>
  static TrainerWiring ddp(DistributedDataParallel<ModuleHolder>& ddp,
                           torch::optim::Optimizer& optimizer) {
    TrainerWiring wiring(ddp.process_group(), ddp.module().ptr(),
                         std::make_unique<TorchOptimizer>(optimizer),
                         std::make_unique<DDPGradientSync<ModuleHolder>>(ddp));
    wiring.set_dcp_state(wiring.model_, optimizer);
    wiring.mode_ = "DDP";
    wiring.broadcasts_buffers_ = ddp.reducer().options().broadcast_buffers;
    wiring.set_leaves(ddp.reducer().options().determinism, ddp.reducer().options().leaves,
                      ddp.local_leaves(), nullptr);
    wiring.set_tensor_parallel("TrainerWiring::ddp", nullptr, /*shards=*/false);
    return wiring;
  }

  /// DDP + ZeRO built from it (ZeroRedundancyOptimizer::make(ddp, ...)): stage 1 steps DDP's
  /// averaged gradients, stage 2 reduces for DDP. A ZeRO that reduces alone is InvalidArgument.
  template <typename ModuleHolder>
  static TrainerWiring ddp(DistributedDataParallel<ModuleHolder>& ddp,
                           ZeroRedundancyOptimizer& zero) {
    if (zero.options().reduce_gradients) {
      throw InvalidArgument(
          "TrainerWiring::ddp: this ZeRO reduces the gradients itself; build it from the DDP "
          "(ZeroRedundancyOptimizer::make(ddp, ...)) or use TrainerWiring::zero without DDP");
    }
    TrainerWiring wiring(ddp.process_group(), ddp.module().ptr(),
                         std::make_unique<ZeroTrainerOptimizer>(zero),
                         std::make_unique<DDPGradientSync<ModuleHolder>>(ddp));
    wiring.refuse_tensor_parallel("TrainerWiring::ddp", zero_tp_refusal());
    wiring.set_dcp_state(wiring.model_, zero);
    wiring.mode_ = "ZeRO over DDP";
    wiring.broadcasts_buffers_ = ddp.reducer().options().broadcast_buffers;
    // make(ddp, ...) checked that ZeRO has DDP's determinism and leaves.
    const auto& o = ddp.reducer().options();
    wiring.set_leaves(o.determinism, o.leaves, ddp.local_leaves(),
                      [z = &zero](double max_norm) { return z->clip_grad_norm(max_norm); });
    return wiring;
  }

  /// ZeRO alone (it reduces the gradients; its no_sync() between micro-batches). A ZeRO built
  /// for DDP (reduce_gradients false) is InvalidArgument.
  static TrainerWiring zero(std::shared_ptr<torch::nn::Module> model,
                            ZeroRedundancyOptimizer& zero) {
    if (!zero.options().reduce_gradients) {
      throw InvalidArgument(
          "TrainerWiring::zero: this ZeRO reduces for a DDP; wire it with TrainerWiring::ddp");
    }
    TrainerWiring wiring(zero.process_group(), std::move(model),
                         std::make_unique<ZeroTrainerOptimizer>(zero),
                         std::make_unique<InStepGradientSync>(zero));
    // ZeRO refused them among its own parameters; the model may hold more.
    wiring.refuse_split_parameters("TrainerWiring::zero");
    wiring.refuse_tensor_parallel("TrainerWiring::zero", zero_tp_refusal());
    wiring.set_dcp_state(wiring.model_, zero);
    wiring.mode_ = "ZeRO without DDP";
    return wiring;
  }

  /// The fused optimizer (it all-reduces its buckets; no DDP), built over model->parameters() in
  /// that order (its checkpoint names their state by the model's names): InvalidArgument
  /// otherwise.
  static TrainerWiring fused(std::shared_ptr<torch::nn::Module> model,
                             FusedDistributedOptimizer& fused) {
    TrainerWiring wiring(fused.process_group(), std::move(model),
                         std::make_unique<FusedTrainerOptimizer>(fused),
                         std::make_unique<InStepGradientSync>());
    wiring.refuse_tensor_parallel(
        "TrainerWiring::fused", "the fused optimizer's checkpoint takes each parameter for whole");
    // Its checkpoint names the state by the model's parameter names.
    const auto params = wiring.model_->parameters();
    const auto& stepped = fused.params();
    if (params.size() != stepped.size() ||
        !std::equal(params.begin(), params.end(), stepped.begin(),
                    [](const torch::Tensor& a, const torch::Tensor& b) { return a.is_same(b); })) {
      throw InvalidArgument("TrainerWiring::fused on rank " + std::to_string(wiring.comm_->rank()) +
                            ": the fused optimizer must be built over model->parameters(), in "
                            "that order");
    }
    wiring.set_dcp_state(wiring.model_, fused);
    wiring.mode_ = "the fused optimizer";
    return wiring;
  }

  /// No DDP: a LibTorch optimizer, the gradients averaged by one all-reduce over `comm` (or
  /// the 1-D mesh's group) after the last micro-batch.
  static TrainerWiring all_reduce(std::shared_ptr<torch::nn::Module> model,
                                  torch::optim::Optimizer& optimizer,
                                  std::shared_ptr<Communicator> comm) {
    if (!model) throw InvalidArgument("TrainerWiring::all_reduce: model is null");
    if (!comm) throw InvalidArgument("TrainerWiring: communicator is null");
    auto sync = std::make_unique<AllReduceGradientSync>(comm, model->parameters());
    TrainerWiring wiring(std::move(comm), std::move(model),
                         std::make_unique<TorchOptimizer>(optimizer), std::move(sync));
    wiring.set_dcp_state(wiring.model_, optimizer);
    wiring.mode_ = "the all-reduce wiring";
    wiring.set_tensor_parallel("TrainerWiring::all_reduce", nullptr, /*shards=*/false);
    return wiring;
  }
  /// The same over a 1-D mesh's group.
  static TrainerWiring all_reduce(std::shared_ptr<torch::nn::Module> model,
                                  torch::optim::Optimizer& optimizer, const DeviceMesh& mesh) {
    return all_reduce(std::move(model), optimizer,
                      one_dimension_group(mesh, "TrainerWiring::all_reduce", "dp"));
  }
  /// The same, the group first (the older order).
  [[deprecated("use TrainerWiring::all_reduce(model, optimizer, comm)")]] static TrainerWiring
  all_reduce(std::shared_ptr<Communicator> comm, std::shared_ptr<torch::nn::Module> model,
             torch::optim::Optimizer& optimizer) {
    return all_reduce(std::move(model), optimizer, std::move(comm));
  }

  /// A pipeline alone (its group is the whole job) with any LibTorch optimizer over
  /// runtime.parameters(): no data parallelism, so the gradients need no averaging.
  /// Checkpoints are distributed, under the stages' names ("stage<index>." and the stage
  /// module's names; a function stage's tensors "stage<index>_<n>"), so they resume with the
  /// same stages over any number of ranks (schedule and pipeline size may change). A weight
  /// tied across stages (PipelineStage::tie; the runtime sums its copies' gradients) counts
  /// once in the global norm and is written once, under the lowest stage's name (its other
  /// copies load from it). Collective over the pipeline group.
  static TrainerWiring pipeline(pipeline::PipelineRuntime& runtime,
                                torch::optim::Optimizer& optimizer);

  /// PP x DP: `mesh` has the dimensions "dp" and "pp" (every rank), `runtime` runs this rank's
  /// stages over mesh["pp"]'s group; the stages' gradients are averaged over mesh["dp"] once per
  /// step, after the pipeline's last backward. InvalidArgument when the runtime's group is not
  /// the mesh's PP group.
  static TrainerWiring pipeline(pipeline::PipelineRuntime& runtime,
                                torch::optim::Optimizer& optimizer, const DeviceMesh& mesh);
  /// The same with the groups given: `world` holds every rank, `dp_group` the ranks holding the
  /// same stages for other shards of the batch.
  [[deprecated(
      "use TrainerWiring::pipeline(runtime, optimizer, mesh) with a \"dp\" x \"pp\" "
      "mesh")]] static TrainerWiring
  pipeline(std::shared_ptr<Communicator> world, pipeline::PipelineRuntime& runtime,
           torch::optim::Optimizer& optimizer, std::shared_ptr<Communicator> dp_group);

  /// TP x PP x DP: `mesh` has the dimensions "pp", "dp" and "tp" (as GradientSynchronizer's),
  /// `runtime` runs this rank's stage (its TP shard) over mesh["pp"]'s group (a
  /// runtime of one stage when pp is 1), `optimizer` is any LibTorch optimizer over
  /// runtime.parameters(), `sync` the mesh's GradientSynchronizer over the same stage. The
  /// global norm counts every parameter once over the mesh (MeshGradNorm). Checkpoints are
  /// distributed (dcp::get_state_dict with the mesh: the unsplit model's names, `tied` as there),
  /// so they resume at any other tp x pp x dp, when every stage has a module and the stage
  /// modules name their layers as the unsplit model does; with a function stage, under the
  /// stages' names (as pipeline()'s), so they resume with the same stages only. With a "cp"
  /// dimension above 1, fit() needs a data source that gives its sample indices
  /// (DataSource::sample_indices), by which it checks that each cp group read the same samples.
  /// The step's bytes per dimension: "tp", "pp" (with the embedding group), "dp" (the sync's
  /// gradient average, over dp x ep x cp), and "ep" and "cp" where the mesh has them.
  /// Weights the stages declare tied (PipelineStage::tie) are summed by the runtime over the
  /// rank's PP group, counted once in the norm and written once (their duplicates' names join
  /// `tied`). InvalidArgument when the runtime's group is not the mesh's PP group, two stage
  /// modules name a layer alike, the synchronizer's shared_embedding is also declared tied
  /// (it would be summed twice), or a function stage without its module holds a tensor split
  /// by tensor parallelism (the norm and the checkpoint find splits through the modules).
  static TrainerWiring mesh(const DeviceMesh& mesh, pipeline::PipelineRuntime& runtime,
                            torch::optim::Optimizer& optimizer, GradientSynchronizer& sync,
                            dcp::TiedNames tied = {});

  /// FSDP: `model` is the root FullyShard, `optimizer` any LibTorch optimizer built over
  /// model->parameters() (the shards). InvalidArgument when the optimizer holds a tensor that is
  /// not one of the model's parameters.
  static TrainerWiring fsdp(FullyShard model, torch::optim::Optimizer& optimizer);

 private:
  // PP x DP over `world`, the stages' gradients averaged over `dp_group`.
  static TrainerWiring pipeline_over(std::shared_ptr<Communicator> world,
                                     pipeline::PipelineRuntime& runtime,
                                     torch::optim::Optimizer& optimizer,
                                     std::shared_ptr<Communicator> dp_group);
  TrainerWiring(std::shared_ptr<Communicator> comm, std::shared_ptr<torch::nn::Module> model,
                std::unique_ptr<TrainerOptimizer> optimizer, std::unique_ptr<GradientSync> sync,
                std::vector<std::shared_ptr<Communicator>> more_traffic = {})
      : TrainingPlan(std::move(comm), std::move(model), std::move(optimizer), std::move(sync),
                     std::move(more_traffic)) {}

  // InvalidArgument on every rank of comm_ when the model holds one rank's
  // part of a split tensor (an MoE's experts: core/rank_local.h), which a
  // wiring other than the mesh's would take for replicated.
  void refuse_split_parameters(const std::string& who) const;

  // The one group the model's tensor-parallel layers run over, or null
  // without any. A layer over a group of one rank (tp = 1) holds its whole
  // tensors and counts as a plain layer. InvalidArgument naming `who` for
  // layers over two groups or sequence-parallel ones (their replicated
  // parameters' gradients are partial per TP rank: only the mesh's
  // synchronizer sums them).
  std::shared_ptr<Communicator> tensor_parallel_group(const std::string& who) const;
  // A model of TP layers under a wiring with one Trainer per TP rank over
  // its data-parallel group (ddp, all_reduce, fsdp): the layout's norm
  // counts each parameter once over TP (TensorParallelGradNorm, summed over
  // `shard_group` first where it is not null), the TP ranks must draw the
  // same samples, TP rank 0 alone reports and checkpoints are refused
  // (ReplicaLayout::set_tensor_parallel), and the parameters whole on every
  // TP rank must hold the same values there (verify_tp_replicas; `shards`:
  // the model's parameters are FSDP's shards). Nothing without TP layers.
  void set_tensor_parallel(const std::string& who, std::shared_ptr<Communicator> shard_group,
                           bool shards);
  // InvalidArgument naming `who`, the parameter and the TP ranks, on every
  // rank, when a parameter of the model whole on every TP rank holds other
  // values on some TP rank of `tp_group` (they would train apart): one
  // all-gather of two doubles per parameter over `tp_group`, then one of a
  // word over comm_ to agree on the verdict (the all-reduce wiring's ranks
  // start from their own values, FSDP's compare their own shards, and a
  // DDP replica changed after DDP's broadcast would differ too). After the
  // data-parallel broadcast.
  void verify_tp_replicas(const std::string& who, Communicator& tp_group, bool shards) const;
  // InvalidArgument naming `who` and `why` when the model holds TP layers
  // (over two or more ranks), which the wiring would take for replicated. The model is the same on
  // every rank, so every rank throws.
  void refuse_tensor_parallel(const std::string& who, const std::string& why) const;
  static std::string zero_tp_refusal() {
    return "ZeRO's norm and checkpoint take its pieces for parts of whole, replicated tensors";
  }

  // A pipeline's layout: its norm, loss copies and dimensions; dp_group may be null.
  void set_pipeline_layout(pipeline::PipelineRuntime& runtime,
                           std::shared_ptr<Communicator> dp_group);

  // A pipeline's or a mesh's: `stages` (this rank's stage modules as one)
  // through the mesh's state dict, whose dimensions other than "pp" say
  // which replica writes each tensor (mesh.h, StateDictOptions).
  void set_stage_state(DeviceMesh mesh, torch::optim::Optimizer& optimizer,
                       std::shared_ptr<torch::nn::Module> stages, dcp::TiedNames tied);

  // dcp::get_state_dict of `model` with `optimizer`, whose type picks the
  // mode's layout (dcp/state_dict/state_dict.h): a LibTorch optimizer over a
  // replicated module or a fully sharded root, ZeRO's pieces, the fused
  // optimizer's buffers.
  template <typename Model, typename Optimizer>
  void set_dcp_state(std::shared_ptr<Model> model, Optimizer& optimizer) {
    dcp_state_ = [model = std::move(model), opt = &optimizer](const dcp::Metadata* for_load) {
      return saving_or_loading(dcp::get_state_dict(*model, *opt), for_load);
    };
  }
};

}  // namespace cohort
