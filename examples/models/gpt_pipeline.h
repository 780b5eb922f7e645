// defines: gpt_pipeline_stage(s), gpt_pipeline_schedule, gpt_pipeline_loss,
// make_gpt_pipeline: a GPTStage's model chunks run by the pipeline's
// schedules (PipelineRuntime over the mesh's PP group).
//
//   auto rt = make_gpt_pipeline(*mesh, stage, "interleaved", m);
//   auto r = rt->step({ids}, {targets});  // ids on the first, targets on the last rank
//   sync.synchronize();                   // DP, TP and the tied embedding
//   optimizer.step();
//
// With config.virtual_stages = v each rank runs its v chunks as the
// pipeline stages k pp + pp_rank (Megatron's interleaved layout), which only
// the interleaved schedule drives. Every TP rank of a stage runs the same
// actions in the same order, so the TP collectives inside the layers
// (forward, I and W alike) match up.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "cohort/mesh/device_mesh.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/pipeline/pipeline_stage.h"
#include "examples/models/gpt_model.h"

namespace cohort::tensor_parallel {

/// `stage` as logical pipeline stage `mesh.local_rank("pp")` (one stage per PP
/// rank): one boundary tensor, the ids [B, T] into the first stage and the
/// hidden states between stages. Throws InvalidArgument when the stage has
/// several chunks (use gpt_pipeline_stages).
pipeline::PipelineStage gpt_pipeline_stage(const DeviceMesh& mesh, GPTStage stage);

/// Each of `stage`'s chunks as its own pipeline stage, k pp + pp_rank,
/// ascending (what PipelineRuntime takes); one stage when v is 1.
std::vector<pipeline::PipelineStage> gpt_pipeline_stages(GPTStage stage);

/// make_schedule(name, pp, config.virtual_stages, microbatches) for the
/// GPT's chunks. Throws InvalidArgument naming the values when v > 1 with a
/// schedule other than "interleaved", or when the interleaved schedule's
/// micro-batches are not a multiple of pp.
pipeline::PipelineSchedule gpt_pipeline_schedule(const DeviceMesh& mesh, const GPTConfig& config,
                                                 const std::string& name, int microbatches);

/// The last stage's loss for PipelineRuntime: GPTStage::loss of the logits.
pipeline::PipelineLossFn gpt_pipeline_loss(GPTStage stage);

/// The runtime of `stage`'s chunks under schedule `name` with `microbatches`
/// micro-batches per step. Collective over the group of mesh["pp"].
std::unique_ptr<pipeline::PipelineRuntime> make_gpt_pipeline(
    const DeviceMesh& mesh, GPTStage stage, const std::string& name, int microbatches,
    pipeline::PipelineOptions options = {});

}  // namespace cohort::tensor_parallel
