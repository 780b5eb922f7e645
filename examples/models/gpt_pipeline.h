// defines: gpt_pipeline_stage, gpt_pipeline_loss: a GPTStage run by the
// pipeline's schedules (PipelineRuntime over the mesh's PP group).
//
//   PipelineRuntime rt(mesh->pp_group(), {gpt_pipeline_stage(*mesh, stage)},
//                      Schedule1F1B(mesh->pp_size(), m), gpt_pipeline_loss(stage));
//   auto r = rt.step({ids}, {targets});   // ids on the first, targets on the last stage
//   sync.synchronize();                   // DP, TP and the tied embedding
//   optimizer.step();
//
// Every TP rank of a stage runs the same actions in the same order, so the
// TP collectives inside the layers (forward, I and W alike) match up.
#pragma once

#include "cohort/mesh/device_mesh.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/pipeline/pipeline_stage.h"
#include "examples/models/gpt_model.h"

namespace cohort::tensor_parallel {

/// `stage` as logical pipeline stage `mesh.pp_rank()` (one stage per PP
/// rank): one boundary tensor, the ids [B, T] into the first stage and the
/// hidden states between stages.
pipeline::PipelineStage gpt_pipeline_stage(const DeviceMesh& mesh, GPTStage stage);

/// The last stage's loss for PipelineRuntime: GPTStage::loss of the logits.
pipeline::PipelineLossFn gpt_pipeline_loss(GPTStage stage);

}  // namespace cohort::tensor_parallel
