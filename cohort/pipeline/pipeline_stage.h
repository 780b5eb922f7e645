// defines: PipelineStage (one logical stage held on this rank), WeightUnit,
// split_sequential, partition_balanced, balance_by_parameters,
// balance_by_time.
//
// A model is an ordered list of layers (a torch::nn::Sequential); a stage is
// a contiguous run of them. Boundaries are the index of each stage's first
// layer after stage 0: {2, 5} splits 7 layers into [0,2) [2,5) [5,7).
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace cohort::pipeline {

using Tensors = std::vector<torch::Tensor>;

/// Whether a tensor crossing a stage boundary carries a gradient back:
/// floating point or complex (autograd differentiates both); integer and
/// bool tensors (masks, token ids) cross forward only.
inline bool carries_gradient(c10::ScalarType dtype) {
  return c10::isFloatingType(dtype) || c10::isComplexType(dtype);
}

/// A part of the stage whose weight gradient W computes on its own: the
/// output of one layer and that layer's parameters.
struct WeightUnit {
  /// The layer's output, whose weight gradient W computes.
  torch::Tensor output;
  /// The layer's parameters.
  std::vector<torch::Tensor> parameters;
};

/// One logical stage: a function from the tensors crossing its input
/// boundary to those crossing its output boundary, and its parameters.
/// The last stage's outputs go to the loss function.
class PipelineStage {
 public:
  /// Maps the tensors at the stage's input boundary to those at its output boundary.
  using ForwardFn = std::function<Tensors(const Tensors& inputs)>;

  /// A stage from a Sequential: one tensor in, one out. Each child with
  /// trainable parameters is a WeightUnit, so that W re-traverses only that child;
  /// unless two children share a parameter (a layer used twice, a tied
  /// weight): a unit's W would then also count the other child's use, so
  /// W differentiates the outputs for all parameters at once.
  PipelineStage(int index, torch::nn::Sequential module);
  /// A stage from any function (a boundary of several tensors, e.g. hidden
  /// states and a mask). W differentiates the outputs for all parameters.
  /// `module` (may be null) keeps the owner of the parameters alive.
  PipelineStage(int index, ForwardFn forward, std::vector<torch::Tensor> parameters,
                std::shared_ptr<torch::nn::Module> module = nullptr);

  /// The logical stage this is (0 .. num_stages - 1).
  int index() const { return index_; }
  /// Every parameter of the stage, each once, frozen or not (as
  /// Module::parameters(): an optimizer built over them steps a parameter
  /// unfrozen later).
  const std::vector<torch::Tensor>& parameters() const { return parameters_; }
  /// Those that require grad now: each backward differentiates these, so a
  /// parameter frozen or unfrozen after construction counts from the next step.
  std::vector<torch::Tensor> trainable_parameters() const;
  /// The module behind the stage (null for a function stage built without).
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }

  /// Declares `parameter`, one of this stage's parameters, this stage's copy
  /// of the weight `key`, which other stages hold too (a tied embedding;
  /// DeepSpeed's TiedLayerSpec). Stages on different ranks cannot share a
  /// tensor: without the declaration each copy gets only its own stage's
  /// part of the gradient and the copies drift apart. The PipelineRuntime
  /// keeps every stage's copy of one key one weight (README, "Tied
  /// weights"). Declaring the same pair again changes nothing. A bad
  /// declaration (an empty `key`, a `parameter` that is not one of the
  /// stage's) and one that conflicts with another of this rank's (another
  /// tensor of this stage under `key`, or `parameter` under another key on
  /// any of its stages) are refused by the PipelineRuntime's constructor
  /// with an InvalidArgument on every rank: a throw here would stop this
  /// rank alone while the others wait for it.
  PipelineStage& tie(const std::string& key, const torch::Tensor& parameter);
  /// The declared copies: (key, this stage's tensor), in declaration order.
  const std::vector<std::pair<std::string, torch::Tensor>>& tied() const { return tied_; }
  /// Why the first bad tie() call was refused, or "" (the runtime raises it).
  const std::string& refused_tie() const { return refused_tie_; }

  /// Runs the stage; fills `units` (Sequential stages) for W.
  Tensors forward(const Tensors& inputs, std::vector<WeightUnit>* units = nullptr) const;

 private:
  int index_;
  torch::nn::Sequential sequential_{nullptr};
  ForwardFn forward_;
  std::vector<torch::Tensor> parameters_;
  std::shared_ptr<torch::nn::Module> module_;
  std::vector<std::pair<std::string, torch::Tensor>> tied_;
  std::string refused_tie_;
  bool weight_units_ = true;  // no parameter in two of the Sequential's children, frozen or not
};

/// Layers [boundaries[stage-1], boundaries[stage]) of `model` as a new
/// Sequential sharing the layer modules: a rank keeps only its stages, the
/// rest is freed with `model`. Throws InvalidArgument on bad boundaries.
torch::nn::Sequential split_sequential(const torch::nn::Sequential& model,
                                       const std::vector<int64_t>& boundaries, int stage);

/// Boundaries that split `weights` (one per layer) into `num_stages`
/// non-empty contiguous runs minimizing the largest sum.
std::vector<int64_t> partition_balanced(const std::vector<double>& weights, int num_stages);

/// Boundaries balancing the number of parameter elements per stage.
std::vector<int64_t> balance_by_parameters(const torch::nn::Sequential& model, int num_stages);

/// Boundaries balancing measured forward + backward time per layer on
/// `sample` (the model's input; the best of `repeats` runs per layer).
std::vector<int64_t> balance_by_time(const torch::nn::Sequential& model,
                                     const torch::Tensor& sample, int num_stages, int repeats = 3);

}  // namespace cohort::pipeline
