#include "examples/models/gpt_pipeline.h"

#include "cohort/core/error.h"

namespace cohort::tensor_parallel {
namespace {

void require(bool ok, const DeviceMesh& mesh, const std::string& what) {
  if (!ok) {
    throw InvalidArgument("cohort: GPT pipeline (pp rank " + std::to_string(mesh.local_rank("pp")) +
                          "): " + what);
  }
}

}  // namespace

pipeline::PipelineStage gpt_pipeline_stage(const DeviceMesh& mesh, GPTStage stage) {
  require(stage->num_chunks() == 1, mesh,
          "gpt_pipeline_stage takes a stage of one chunk, not virtual_stages " +
              std::to_string(stage->num_chunks()) + " (use gpt_pipeline_stages)");
  return gpt_pipeline_stages(stage).front();
}

std::vector<pipeline::PipelineStage> gpt_pipeline_stages(GPTStage stage) {
  std::shared_ptr<GPTStageImpl> impl = stage.ptr();
  std::vector<pipeline::PipelineStage> out;
  for (int k = 0; k < impl->num_chunks(); ++k) {
    auto forward = [impl, k](const pipeline::Tensors& in) -> pipeline::Tensors {
      return {impl->forward_chunk(k, in.at(0))};
    };
    out.emplace_back(impl->chunk_index(k), forward, impl->chunk_parameters(k), impl);
  }
  return out;
}

pipeline::PipelineSchedule gpt_pipeline_schedule(const DeviceMesh& mesh, const GPTConfig& config,
                                                 const std::string& name, int microbatches) {
  const int pp = mesh.size("pp"), v = config.virtual_stages;
  require(v == 1 || name == "interleaved", mesh,
          "virtual_stages " + std::to_string(v) + " needs the interleaved schedule, not '" + name +
              "'");
  require(name != "interleaved" || (microbatches > 0 && microbatches % pp == 0), mesh,
          "the interleaved schedule needs micro-batches a positive multiple of pp " +
              std::to_string(pp) + "; got " + std::to_string(microbatches) + " (virtual_stages " +
              std::to_string(v) + ")");
  return pipeline::make_schedule(name, pp, v, microbatches);
}

pipeline::PipelineLossFn gpt_pipeline_loss(GPTStage stage) {
  std::shared_ptr<GPTStageImpl> impl = stage.ptr();
  return [impl](const pipeline::Tensors& out, const pipeline::Tensors& targets) {
    return impl->loss(out.at(0), targets.at(0));
  };
}

std::unique_ptr<pipeline::PipelineRuntime> make_gpt_pipeline(const DeviceMesh& mesh, GPTStage stage,
                                                             const std::string& name,
                                                             int microbatches,
                                                             pipeline::PipelineOptions options) {
  return std::make_unique<pipeline::PipelineRuntime>(
      mesh["pp"], gpt_pipeline_stages(stage),
      gpt_pipeline_schedule(mesh, stage->config(), name, microbatches), gpt_pipeline_loss(stage),
      options);
}

}  // namespace cohort::tensor_parallel
