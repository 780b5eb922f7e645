#include "cohort/activation/checkpoint_wrapper.h"

#include "cohort/core/error.h"

namespace cohort {

CheckpointWrapperImpl::CheckpointWrapperImpl(torch::nn::AnyModule module, CheckpointOptions options)
    : options_(options) {
  if (module.is_empty()) throw InvalidArgument("checkpoint_wrapper: no module to wrap");
  module_ = register_module("module", module.ptr());
  call_ = [module](const torch::Tensor& x) mutable { return module.forward<torch::Tensor>(x); };
}

CheckpointWrapperImpl::CheckpointWrapperImpl(torch::nn::Sequential module,
                                             CheckpointOptions options)
    : options_(options) {
  if (module.is_empty() || module->size() == 0)
    throw InvalidArgument("checkpoint_wrapper: no module to wrap");
  module_ = register_module("module", module.ptr());
  call_ = [module](const torch::Tensor& x) mutable { return module->forward(x); };
}

torch::Tensor CheckpointWrapperImpl::forward(const torch::Tensor& input) {
  // The wrapped module's buffers as they are now (assigning a buffer
  // replaces its tensor), so that its recompute leaves them as it finds them.
  CheckpointOptions options = options_;
  for (const auto& b : buffers()) options.buffers.push_back(b);
  return checkpoint(call_, input, parameters(), options);
}

CheckpointWrapper checkpoint_wrapper(torch::nn::AnyModule module, CheckpointOptions options) {
  return CheckpointWrapper(std::move(module), options);
}

CheckpointWrapper checkpoint_wrapper(torch::nn::Sequential module, CheckpointOptions options) {
  return CheckpointWrapper(std::move(module), options);
}

torch::nn::Sequential checkpoint_blocks(const torch::nn::Sequential& model,
                                        CheckpointOptions options) {
  if (model.is_empty()) throw InvalidArgument("checkpoint_blocks: no model");
  std::vector<torch::nn::Sequential> blocks;
  torch::nn::Sequential block;
  bool block_has_params = false;
  for (const auto& layer : *model) {
    const bool has_params = !layer.ptr()->parameters().empty();
    if (has_params && block_has_params) {
      blocks.push_back(block);
      block = torch::nn::Sequential();
      block_has_params = false;
    }
    block->push_back(layer);
    block_has_params = block_has_params || has_params;
  }
  if (block->size() > 0) blocks.push_back(block);
  torch::nn::Sequential out;
  for (auto& b : blocks) out->push_back(checkpoint_wrapper(b, options));
  return out;
}

}  // namespace cohort
