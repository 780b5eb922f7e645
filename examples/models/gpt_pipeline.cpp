#include "examples/models/gpt_pipeline.h"

namespace cohort::tensor_parallel {

pipeline::PipelineStage gpt_pipeline_stage(const DeviceMesh& mesh, GPTStage stage) {
  std::shared_ptr<GPTStageImpl> impl = stage.ptr();
  auto forward = [impl](const pipeline::Tensors& in) -> pipeline::Tensors {
    return {impl->forward(in.at(0))};
  };
  return pipeline::PipelineStage(mesh.pp_rank(), forward, impl->parameters(), impl);
}

pipeline::PipelineLossFn gpt_pipeline_loss(GPTStage stage) {
  std::shared_ptr<GPTStageImpl> impl = stage.ptr();
  return [impl](const pipeline::Tensors& out, const pipeline::Tensors& targets) {
    return impl->loss(out.at(0), targets.at(0));
  };
}

}  // namespace cohort::tensor_parallel
