#include "cohort/wiring/trainer_wiring.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "cohort/core/agreement.h"
#include "cohort/core/rank_local.h"
#include "cohort/dcp/collective_status.h"
#include "cohort/expert_parallel/moe.h"
#include "cohort/fsdp/fsdp_adapters.h"
#include "cohort/grad_sync/parameter_check.h"
#include "cohort/mesh/tensor_parallel_module.h"
#include "cohort/mesh/tp_replicas.h"
#include "cohort/pipeline/pipeline_layout.h"
#include "cohort/wiring/mesh_wiring.h"

namespace cohort {
namespace {

// This rank's stages as one module, so that the Trainer's model-wide steps
// (train(), parameters(), a checkpoint's save and load) see exactly them:
// each stage's module under "stage<index>", or, for a function stage
// without one, its parameters under "stage<index>_<n>". A module that
// several stages share (one model holding a rank's interleaved chunks) is
// registered once, under its first stage: twice, its parameters would be
// counted twice by the norm and scaled twice by clipping. So is a function
// stage's tensor that an earlier stage already holds (a weight two
// function stages share): under its first name only.
std::shared_ptr<torch::nn::Module> stages_module(const pipeline::PipelineRuntime& runtime) {
  auto holder = std::make_shared<torch::nn::Module>("PipelineStages");
  std::set<const torch::nn::Module*> registered;
  std::set<const c10::TensorImpl*> held;
  for (const auto& stage : runtime.stages()) {
    const std::string name = "stage" + std::to_string(stage.index());
    if (stage.module()) {
      if (registered.insert(stage.module().get()).second) {
        holder->register_module(name, stage.module());
        for (const auto& p : stage.module()->parameters()) held.insert(p.unsafeGetTensorImpl());
      }
      continue;
    }
    for (size_t i = 0; i < stage.parameters().size(); ++i) {
      const auto& p = stage.parameters()[i];
      if (!held.insert(p.unsafeGetTensorImpl()).second) continue;
      // register_parameter sets requires_grad: keep a frozen tensor frozen.
      holder->register_parameter(name + "_" + std::to_string(i), p, p.requires_grad());
    }
  }
  return holder;
}

// This rank's stage modules as one module under the unsplit model's names
// (each stage module's children and own tensors, unprefixed), for
// dcp::get_state_dict; null when a stage is a function (its
// tensors have no names). A module shared by several stages counts once.
std::shared_ptr<torch::nn::Module> unsplit_stages(const pipeline::PipelineRuntime& runtime,
                                                  int rank) {
  auto holder = std::make_shared<torch::nn::Module>("PipelineStages");
  std::set<const torch::nn::Module*> seen;
  auto clash = [&](const std::string& name) {
    return InvalidArgument("TrainerWiring::mesh on rank " + std::to_string(rank) +
                           ": two of this rank's stage modules hold '" + name +
                           "'; stage modules must name their layers as the unsplit model does");
  };
  for (const auto& stage : runtime.stages()) {
    if (!stage.module()) return nullptr;
    if (!seen.insert(stage.module().get()).second) continue;
    for (const auto& child : stage.module()->named_children()) {
      if (holder->named_children().contains(child.key())) throw clash(child.key());
      holder->register_module(child.key(), child.value());
    }
    for (const auto& p : stage.module()->named_parameters(/*recurse=*/false)) {
      if (holder->named_parameters(false).contains(p.key())) throw clash(p.key());
      holder->register_parameter(p.key(), p.value(), p.value().requires_grad());
    }
    for (const auto& b : stage.module()->named_buffers(/*recurse=*/false)) {
      if (holder->named_buffers(false).contains(b.key())) throw clash(b.key());
      holder->register_buffer(b.key(), b.value());
    }
  }
  return holder;
}

// Why the mesh's synchronizer would reduce `stages`' experts wrongly, or
// empty: its expert list must be exactly the MoE layers' experts. One left
// out is averaged over "ep" with other experts; a dense parameter listed is
// summed over the replicas only, missing the other ep ranks' tokens.
std::string expert_list_mismatch(const torch::nn::Module& stages,
                                 const std::vector<torch::Tensor>& listed) {
  std::set<const void*> given, experts;
  for (const auto& t : listed) given.insert(t.unsafeGetTensorImpl());
  for (const auto& t : expert_parallel::expert_parameters(stages)) {
    experts.insert(t.unsafeGetTensorImpl());
  }
  const std::string which =
      "GradientSynchronizerOptions::expert_parameters must be "
      "expert_parallel::expert_parameters(stage), the experts of every MoE layer (" +
      std::to_string(experts.size()) + " tensors here), and holds " + std::to_string(given.size()) +
      "; ";
  for (const auto& p : stages.named_parameters()) {
    const void* impl = p.value().unsafeGetTensorImpl();
    if (experts.count(impl) && !given.count(impl)) {
      return which + "'" + p.key() + "' is missing (it would be averaged with other experts)";
    }
    if (given.count(impl) && !experts.count(impl)) {
      return which + "'" + p.key() +
             "' is no expert (its gradient would miss the other ep ranks' tokens)";
    }
  }
  for (const auto& t : listed) {
    if (!experts.count(t.unsafeGetTensorImpl())) {
      return which + "a tensor of shape " + c10::str(t.sizes()) + " is no parameter of the stages";
    }
  }
  return "";
}

// This rank's copies of the runtime's tied weights that are not the
// original: the norm leaves them out (their gradients equal the original's).
std::vector<torch::Tensor> tied_duplicates(const pipeline::PipelineRuntime& runtime) {
  std::vector<torch::Tensor> out;
  for (const auto& tied : runtime.tied_weights()) {
    for (const auto& t : tied.copies->duplicates()) out.push_back(t);
  }
  return out;
}

// The checkpoint names of this rank's duplicate copies -> the original's
// name in `stages` on its rank (gathered over the pipeline group, one
// exchange for all keys): the copies are never written and load from the
// original, so the weight is saved once.
dcp::TiedNames tied_names(const pipeline::PipelineRuntime& runtime,
                          const torch::nn::Module& stages) {
  const auto& tied = runtime.tied_weights();
  if (tied.empty()) return {};
  std::map<const void*, std::string> names;
  for (const auto& p : stages.named_parameters()) names[p.value().unsafeGetTensorImpl()] = p.key();
  auto name_of = [&](const torch::Tensor& t) {
    const auto it = names.find(t.unsafeGetTensorImpl());
    COHORT_CHECK(it != names.end(), "TrainerWiring::pipeline: a tied copy is not a parameter");
    return it->second;
  };
  std::string originals;  // per key: this rank's original's name or nothing, then '\0'
  for (const auto& t : tied) {
    if (t.copies->holds_original()) originals += name_of(t.copies->copies().front());
    originals += '\0';
  }
  std::vector<std::string> original(tied.size());
  for (const auto& text : gather_texts(*runtime.process_group(), originals)) {
    size_t at = 0;
    for (size_t k = 0; k < tied.size(); ++k) {
      const size_t end = text.find('\0', at);
      if (end > at) original[k] = text.substr(at, end - at);
      at = end + 1;
    }
  }
  dcp::TiedNames out;
  for (size_t k = 0; k < tied.size(); ++k) {
    for (const auto& t : tied[k].copies->duplicates()) out[name_of(t)] = original[k];
  }
  return out;
}

// Why the runtime's declared ties and the synchronizer's tied embedding
// cannot both be kept, or "": a tensor in both would be summed twice.
std::string embedding_also_declared(const pipeline::PipelineRuntime& runtime,
                                    const torch::Tensor& embedding) {
  if (!embedding.defined()) return "";
  for (const auto& tied : runtime.tied_weights()) {
    for (const auto& t : tied.copies->copies()) {
      if (t.is_same(embedding)) {
        return "the synchronizer's shared_embedding is also declared tied as '" + tied.key +
               "' (PipelineStage::tie): its gradient would be summed twice; keep it through "
               "one of them";
      }
    }
  }
  return "";
}

// Why the mesh's norm and checkpoint would miscount a stage, or "": they
// find a tensor-parallel split through the stage modules' layers, so a
// function stage's split tensor would be counted and saved as whole (on TP
// rank 0 only, every TP rank's part under one name).
std::string function_stage_split(const pipeline::PipelineRuntime& runtime) {
  for (const auto& stage : runtime.stages()) {
    if (stage.module()) continue;
    for (size_t i = 0; i < stage.parameters().size(); ++i) {
      const auto part = tensor_parallel_part(stage.parameters()[i]);
      if (part.size < 2) continue;
      return "stage " + std::to_string(stage.index()) + " is a function whose parameter " +
             std::to_string(i) + " is TP rank " + std::to_string(part.rank) + " of " +
             std::to_string(part.size) + "'s part of a tensor split over '" + part.group +
             "'; the norm and the checkpoint find the split through the stage's module: build "
             "the stage with the module that holds its tensor-parallel layers "
             "(PipelineStage(index, forward, parameters, module))";
    }
  }
  return "";
}

const char* const pipeline_tp_refusal =
    "the pipeline's norm and checkpoint take each stage's tensors for whole";

bool mesh_has(const DeviceMesh& mesh, const std::string& name) {
  const auto names = mesh.dim_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

// Each dimension's communicators, each once. The gradients are averaged
// over the sync's dense group (dp x ep x cp, a communicator of its own
// where ep or cp is above 1) and the experts' over dp x cp: both are the
// data-parallel reduction, so "dp" counts them with the "dp" group itself.
// "cp" is ring attention's group (its K/V blocks, its agreement and the
// sequence loss), "ep" the experts' all-to-all.
TrafficDimensions mesh_dimensions(const DeviceMesh& mesh, const GradientSynchronizer& sync,
                                  const pipeline::PipelineRuntime& runtime) {
  auto once = [](std::vector<std::shared_ptr<Communicator>>& to,
                 const std::shared_ptr<Communicator>& c) {
    if (c && std::find(to.begin(), to.end(), c) == to.end()) to.push_back(c);
  };
  std::vector<std::shared_ptr<Communicator>> pp, dp;
  once(pp, mesh["pp"].process_group());
  once(pp, sync.embedding_group());
  // The declared ties' sums run within this rank's "pp" group: over the
  // ranks holding a copy at the same dp, tp, ep and cp coordinates.
  for (const auto& tied : runtime.tied_weights()) {
    if (tied.copies->group() && tied.copies->group()->size() > 1) once(pp, tied.copies->group());
  }
  for (const auto& c :
       {mesh["dp"].process_group(), sync.dense_group(), sync.expert_replica_group()}) {
    once(dp, c);
  }
  TrafficDimensions dims{{"tp", {mesh["tp"].process_group()}}, {"pp", pp}, {"dp", dp}};
  for (const char* name : {"ep", "cp"}) {
    if (mesh_has(mesh, name)) dims.push_back({name, {mesh[name].process_group()}});
  }
  return dims;
}

}  // namespace

std::shared_ptr<Communicator> TrainerWiring::tensor_parallel_group(const std::string& who) const {
  const std::string where = who + " on rank " + std::to_string(comm_->rank()) + ": ";
  std::shared_ptr<Communicator> group;
  std::string first;
  auto take = [&](const std::string& name, const std::shared_ptr<Communicator>& g, bool sp) {
    if (!g) throw InvalidArgument(where + "the tensor-parallel layer '" + name + "' has no group");
    // Over a group of one rank the layer holds its whole tensors and its
    // collectives (sequence-parallel ones too) change nothing: a plain layer.
    if (g->size() == 1) return;
    // Its replicated parameters' (LayerNorms', a row bias's) gradients are
    // then partial on each TP rank: only the mesh's synchronizer sums them.
    if (sp) {
      throw InvalidArgument(where + "the tensor-parallel layer '" + name +
                            "' is sequence-parallel, whose replicated parameters' gradients "
                            "need a sum over the TP group that only TrainerWiring::mesh's "
                            "GradientSynchronizer makes");
    }
    if (!group) {
      group = g;
      first = name;
    } else if (g != group) {
      throw InvalidArgument(where + "the tensor-parallel layers '" + first + "' and '" + name +
                            "' run over different groups; a model's TP layers share one");
    }
  };
  // Every layer that says its layout (cohort's TP layers and one's own).
  for (const auto& item : model_->named_modules("model")) {
    if (const auto* m = dynamic_cast<const TensorParallelModule*>(item.value().get())) {
      take(item.key(), m->tensor_parallel_group(), m->sequence_parallel());
    }
  }
  return group;
}

void TrainerWiring::set_tensor_parallel(const std::string& who,
                                        std::shared_ptr<Communicator> shard_group, bool shards) {
  auto tp_group = tensor_parallel_group(who);
  if (!tp_group) return;
  verify_tp_replicas(who, *tp_group, shards);
  auto* layout = dynamic_cast<ReplicaLayout*>(layout_.get());
  COHORT_CHECK(layout != nullptr, who + ": a model of TP layers needs a ReplicaLayout");
  layout->set_tensor_parallel(
      std::make_shared<TensorParallelGradNorm>(*model_, tp_group, std::move(shard_group)),
      tp_group);
  if (std::find(traffic_.begin(), traffic_.end(), tp_group) == traffic_.end()) {
    traffic_.push_back(tp_group);
  }
}

void TrainerWiring::verify_tp_replicas(const std::string& who, Communicator& tp_group,
                                       bool shards) const {
  // FSDP's parameters are this rank's rows of each tensor: a replica's rows
  // sit on the same data-parallel rank of every TP group (same shape, same
  // cut), so the shards compared over TP and the verdicts agreed over the
  // data-parallel ranks cover every row.
  const auto mismatch = tp_replica_values_mismatch(tp_group, tp_replicated_parameters(*model_),
                                                   shards ? " of this rank's FSDP shard" : "");
  dcp::agree(*comm_, mismatch.empty() ? "" : who + ": " + mismatch,
             dcp::ErrorKind::InvalidArgument);
}

void TrainerWiring::refuse_tensor_parallel(const std::string& who, const std::string& why) const {
  if (!tensor_parallel_group(who)) return;
  throw InvalidArgument(who + " on rank " + std::to_string(comm_->rank()) +
                        ": the model holds tensor-parallel layers, and " + why +
                        "; train it with TrainerWiring::mesh (a runtime of one stage when "
                        "there is no pipeline)");
}

void TrainerWiring::refuse_split_parameters(const std::string& who) const {
  std::vector<torch::Tensor> params;
  std::vector<std::string> names;
  for (const auto& p : model_->named_parameters()) {
    params.push_back(p.value());
    names.push_back(p.key());
  }
  verify_not_rank_local(*comm_, params, names, who);
}

TrainerWiring TrainerWiring::pipeline(pipeline::PipelineRuntime& runtime,
                                      torch::optim::Optimizer& optimizer) {
  TrainerWiring wiring(runtime.process_group(), stages_module(runtime),
                       std::make_unique<TorchOptimizer>(optimizer),
                       std::make_unique<LocalGradientSync>());
  // No data parallelism, but the checkpoint and the norm take each stage's
  // tensors for whole: an expert split over ranks would be saved as one part.
  wiring.refuse_split_parameters("TrainerWiring::pipeline");
  wiring.refuse_tensor_parallel("TrainerWiring::pipeline", pipeline_tp_refusal);
  wiring.set_pipeline_layout(runtime, nullptr);
  // Every rank writes all of its stages' tensors (they are its alone), but
  // a tied weight's duplicates.
  wiring.set_stage_state(DeviceMesh::from_group(runtime.process_group(), "pp"), optimizer,
                         wiring.model_, tied_names(runtime, *wiring.model_));
  wiring.mode_ = "a pipeline";
  return wiring;
}

TrainerWiring TrainerWiring::pipeline(pipeline::PipelineRuntime& runtime,
                                      torch::optim::Optimizer& optimizer, const DeviceMesh& mesh) {
  if (runtime.process_group() != mesh["pp"].process_group()) {
    throw InvalidArgument("TrainerWiring::pipeline on rank " + std::to_string(mesh.rank()) +
                          ": the pipeline runtime must run over the mesh's PP group");
  }
  return pipeline_over(mesh.process_group(), runtime, optimizer, mesh["dp"].process_group());
}

TrainerWiring TrainerWiring::pipeline(std::shared_ptr<Communicator> world,
                                      pipeline::PipelineRuntime& runtime,
                                      torch::optim::Optimizer& optimizer,
                                      std::shared_ptr<Communicator> dp_group) {
  return pipeline_over(std::move(world), runtime, optimizer, std::move(dp_group));
}

TrainerWiring TrainerWiring::pipeline_over(std::shared_ptr<Communicator> world,
                                           pipeline::PipelineRuntime& runtime,
                                           torch::optim::Optimizer& optimizer,
                                           std::shared_ptr<Communicator> dp_group) {
  if (!world || !dp_group) {
    throw InvalidArgument(
        "TrainerWiring::pipeline: the world and the data-parallel group must "
        "not be null");
  }
  const int pp = runtime.process_group()->size();
  if (world->size() != pp * dp_group->size()) {
    throw InvalidArgument("TrainerWiring::pipeline on rank " + std::to_string(world->rank()) +
                          ": the world has " + std::to_string(world->size()) +
                          " ranks, not pipeline " + std::to_string(pp) + " x data-parallel " +
                          std::to_string(dp_group->size()));
  }
  auto sync = std::make_unique<AllReduceGradientSync>(dp_group, runtime.parameters());
  TrainerWiring wiring(std::move(world), stages_module(runtime),
                       std::make_unique<TorchOptimizer>(optimizer), std::move(sync),
                       {runtime.process_group(), dp_group});
  wiring.refuse_tensor_parallel("TrainerWiring::pipeline", pipeline_tp_refusal);
  wiring.set_pipeline_layout(runtime, dp_group);
  // The replicas of a stage (its data-parallel group) take turns writing
  // its tensors; the pipeline dimension needs no mesh, since no two stages
  // share a name (a tied weight's duplicates are not written).
  wiring.set_stage_state(DeviceMesh::from_group(dp_group, "dp"), optimizer, wiring.model_,
                         tied_names(runtime, *wiring.model_));
  wiring.mode_ = "a pipeline";
  return wiring;
}

void TrainerWiring::set_pipeline_layout(pipeline::PipelineRuntime& runtime,
                                        std::shared_ptr<Communicator> dp_group) {
  // The DP sync already averaged the stages' gradients: the squares sum over
  // the pipeline group only, a tied weight counted once.
  std::vector<std::shared_ptr<Communicator>> pp = {runtime.process_group()};
  for (const auto& tied : runtime.tied_weights()) {
    const auto& group = tied.copies->group();
    if (group && group->size() > 1) {
      pp.push_back(group);
      traffic_.push_back(group);
    }
  }
  TrafficDimensions dims = {{"pp", pp}};
  if (dp_group) dims.push_back({"dp", {std::move(dp_group)}});
  layout_ = std::make_unique<PipelineLayout>(
      runtime, std::make_shared<ShardedGradNorm>(runtime.process_group(), tied_duplicates(runtime)),
      runtime.process_group()->size(), std::move(dims));
}

TrainerWiring TrainerWiring::mesh(const DeviceMesh& mesh, pipeline::PipelineRuntime& runtime,
                                  torch::optim::Optimizer& optimizer, GradientSynchronizer& sync,
                                  dcp::TiedNames tied) {
  if (runtime.process_group() != mesh["pp"].process_group()) {
    throw InvalidArgument("TrainerWiring::mesh on rank " + std::to_string(mesh.rank()) +
                          ": the pipeline runtime must run over the mesh's PP group");
  }
  const auto dims = mesh_dimensions(mesh, sync, runtime);
  std::vector<std::shared_ptr<Communicator>> more;
  for (const auto& [name, groups] : dims) more.insert(more.end(), groups.begin(), groups.end());
  TrainerWiring wiring(mesh.process_group(), stages_module(runtime),
                       std::make_unique<TorchOptimizer>(optimizer),
                       std::make_unique<MeshGradientSync>(sync), more);
  // The sync, the norm and the checkpoint place each expert by the mesh's
  // "ep" and "tp" and take the sync's list for the experts: MoE layers split
  // otherwise, or a list that is not theirs, would train and save a wrong
  // model. Agreed, so every rank throws the first failing rank's reason.
  auto error = expert_parallel::mesh_mismatch(*wiring.model_, mesh);
  if (error.empty()) error = expert_list_mismatch(*wiring.model_, sync.expert_parameters());
  if (error.empty()) error = embedding_also_declared(runtime, sync.shared_embedding());
  if (error.empty()) error = function_stage_split(runtime);
  dcp::agree(*mesh.process_group(), error.empty() ? "" : "TrainerWiring::mesh: " + error,
             dcp::ErrorKind::InvalidArgument);
  // The last stage's copy of the tied embedding (pp > 1) and the declared
  // ties' duplicates are no parameters of their own.
  const int stages = mesh.size("pp");
  const bool copy = stages > 1 && mesh.local_rank("pp") == stages - 1;
  std::vector<torch::Tensor> left_out = tied_duplicates(runtime);
  if (copy && sync.shared_embedding().defined()) left_out.push_back(sync.shared_embedding());
  auto norm = std::make_shared<MeshGradNorm>(mesh, *wiring.model_, left_out);
  // The cp ranks share their samples (each holds part of every sequence),
  // which fit() checks by the samples' indices.
  const bool has_cp = mesh_has(mesh, "cp");
  std::vector<std::shared_ptr<Communicator>> cp_groups;
  if (has_cp) cp_groups.push_back(mesh["cp"].process_group());
  wiring.layout_ = std::make_unique<PipelineLayout>(
      runtime, std::move(norm), stages * mesh.size("tp") * (has_cp ? mesh.size("cp") : 1), dims,
      std::move(cp_groups));
  // The unsplit model's names when every stage is a module (the checkpoint
  // then resumes at any tp x pp x dp); the stages' own names otherwise.
  // A declared tie's duplicates load from the original, as the caller's `tied`.
  auto unsplit = unsplit_stages(runtime, mesh.rank());
  auto named = unsplit ? unsplit : wiring.model_;
  for (auto& [copy_name, original] : tied_names(runtime, *named)) tied[copy_name] = original;
  wiring.set_stage_state(mesh, optimizer, named, std::move(tied));
  wiring.mode_ = "a TP x PP x DP mesh";
  return wiring;
}

TrainerWiring TrainerWiring::fsdp(FullyShard model, torch::optim::Optimizer& optimizer) {
  if (model.is_empty()) throw InvalidArgument("TrainerWiring::fsdp: model is null");
  // The Trainer's own collectives (the loss, checkpoints, agreement) span
  // every data-parallel rank: under HSDP the whole mesh, not one replica's
  // shard group. The norm sums the shards over the shard group (FSDPLayout).
  auto comm = model->mesh().process_group();
  // An optimizer over other tensors (another model's, copies) would step
  // values the model never reads.
  std::set<const void*> mine;
  for (const auto& p : model->parameters()) mine.insert(p.unsafeGetTensorImpl());
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (!mine.count(p.unsafeGetTensorImpl())) {
        throw InvalidArgument("TrainerWiring::fsdp on rank " + std::to_string(comm->rank()) +
                              ": the optimizer holds a tensor of shape " + c10::str(p.sizes()) +
                              " that is not a parameter of the fully sharded model; build it "
                              "over model->parameters()");
      }
    }
  }
  std::vector<std::shared_ptr<Communicator>> traffic = {model->process_group()};
  if (model->replicate_group()) traffic.push_back(model->replicate_group());
  TrainerWiring wiring(comm, model.ptr(), std::make_unique<FSDPTrainerOptimizer>(optimizer),
                       std::make_unique<FSDPGradientSync>(model), std::move(traffic));
  wiring.layout_ = std::make_unique<FSDPLayout>(*wiring.sync_, *model);
  // FSDP x TP: the squares of this TP rank's shards over the shard group,
  // then over TP. The canonical norm of WorldSizeInvariant counts the shard
  // group alone.
  if (model->options().determinism == Determinism::WorldSizeInvariant &&
      wiring.tensor_parallel_group("TrainerWiring::fsdp")) {
    throw InvalidArgument("TrainerWiring::fsdp on rank " + std::to_string(comm->rank()) +
                          ": Determinism::WorldSizeInvariant over tensor-parallel layers: its "
                          "canonical norm (FullyShard::clip_grad_norm) sums this TP rank's "
                          "shards alone");
  }
  wiring.set_tensor_parallel("TrainerWiring::fsdp", model->process_group(),
                             /*shards=*/true);
  std::shared_ptr<FullyShardImpl> root = model.ptr();
  wiring.set_dcp_state(root, optimizer);
  wiring.mode_ = "FSDP";
  wiring.broadcasts_buffers_ = true;  // before each training forward
  wiring.set_leaves(model->options().determinism, model->options().leaves, model->local_leaves(),
                    [root](double max_norm) { return root->clip_grad_norm(max_norm); });
  return wiring;
}

void TrainerWiring::set_stage_state(DeviceMesh mesh, torch::optim::Optimizer& optimizer,
                                    std::shared_ptr<torch::nn::Module> stages,
                                    dcp::TiedNames tied) {
  dcp_state_ = [stages = std::move(stages), mesh = std::move(mesh), opt = &optimizer,
                tied = std::move(tied)](const dcp::Metadata* for_load) {
    dcp::StateDictOptions options;
    options.mesh = &mesh;
    options.tied = tied;
    return saving_or_loading(dcp::get_state_dict(*stages, *opt, options), for_load);
  };
}

}  // namespace cohort
