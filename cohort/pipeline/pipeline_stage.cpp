#include "cohort/pipeline/pipeline_stage.h"

#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"

namespace cohort::pipeline {
namespace {

// Those of `params` requiring grad now.
std::vector<torch::Tensor> requiring_grad(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params)
    if (p.requires_grad()) out.push_back(p);
  return out;
}

// Each once (LibTorch's parameters() lists a tensor registered twice twice:
// a gradient asked for each copy would be added twice into .grad); an
// undefined tensor (an optional parameter left unset) is no parameter.
std::vector<torch::Tensor> each_once(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : unique_tensors(params))
    if (p.defined()) out.push_back(p);
  return out;
}

std::vector<torch::Tensor> trainable(const std::vector<torch::Tensor>& params) {
  return requiring_grad(each_once(params));
}

void check_boundaries(const std::vector<int64_t>& b, int64_t layers, const char* op) {
  int64_t prev = 0;
  for (int64_t x : b) {
    if (x <= prev || x >= layers)
      throw InvalidArgument(std::string(op) + ": boundaries must increase strictly inside (0, " +
                            std::to_string(layers) + ") so that no stage is empty");
    prev = x;
  }
}

}  // namespace

PipelineStage::PipelineStage(int index, torch::nn::Sequential module)
    : index_(index), sequential_(module), module_(module.ptr()) {
  if (module.is_empty() || module->size() == 0)
    throw InvalidArgument("PipelineStage: stage " + std::to_string(index) + " has no layers");
  parameters_ = each_once(module->parameters());
  // W takes a unit's weight gradient from that layer's output gradient,
  // which follows every path from the output back to the parameters: a
  // parameter that an earlier layer uses too (a layer used twice, a tied
  // weight) would get that layer's part a second time. Such a stage's W
  // differentiates its outputs for all its parameters at once instead.
  // Frozen parameters count: one may be unfrozen after construction.
  size_t per_layer = 0;
  for (const auto& layer : *module) per_layer += each_once(layer.ptr()->parameters()).size();
  weight_units_ = per_layer == parameters_.size();
}

PipelineStage::PipelineStage(int index, ForwardFn forward, std::vector<torch::Tensor> parameters,
                             std::shared_ptr<torch::nn::Module> module)
    : index_(index),
      forward_(std::move(forward)),
      parameters_(each_once(parameters)),
      module_(std::move(module)) {
  if (!forward_)
    throw InvalidArgument("PipelineStage: stage " + std::to_string(index) +
                          " has no forward function");
}

std::vector<torch::Tensor> PipelineStage::trainable_parameters() const {
  return requiring_grad(parameters_);
}

PipelineStage& PipelineStage::tie(const std::string& key, const torch::Tensor& parameter) {
  // A bad declaration is kept aside, not thrown: the runtime's construction
  // refuses it on every rank of the pipeline, where a throw here would stop
  // this rank alone while the others wait for it. So is a declaration that
  // conflicts with another (two tensors under one key, one tensor under two
  // keys), which the runtime finds.
  const std::string here = "stage " + std::to_string(index_) + " ";
  const bool mine = parameter.defined() &&
                    std::any_of(parameters_.begin(), parameters_.end(),
                                [&](const torch::Tensor& p) { return p.is_same(parameter); });
  if (key.empty() || !mine) {
    if (refused_tie_.empty())
      refused_tie_ = key.empty() ? here + "ties a tensor under an empty key"
                                 : here + "ties as '" + key +
                                       "' a tensor that is not one of the stage's parameters";
    return *this;
  }
  for (const auto& [k, t] : tied_) {
    if (k == key && t.is_same(parameter)) return *this;
  }
  tied_.emplace_back(key, parameter);
  return *this;
}

Tensors PipelineStage::forward(const Tensors& inputs, std::vector<WeightUnit>* units) const {
  if (forward_) return forward_(inputs);
  if (inputs.size() != 1)
    throw InvalidArgument("PipelineStage: Sequential stage " + std::to_string(index_) +
                          " takes one tensor, got " + std::to_string(inputs.size()));
  torch::Tensor x = inputs[0];
  for (auto& layer : *sequential_.ptr()) {
    x = layer.forward(x);
    if (!units || !weight_units_) continue;
    auto params = trainable(layer.ptr()->parameters());
    if (!params.empty()) units->push_back({x, std::move(params)});
  }
  return {x};
}

torch::nn::Sequential split_sequential(const torch::nn::Sequential& model,
                                       const std::vector<int64_t>& boundaries, int stage) {
  const int64_t n = static_cast<int64_t>(model->size());
  check_boundaries(boundaries, n, "split_sequential");
  if (stage < 0 || stage > static_cast<int>(boundaries.size()))
    throw InvalidArgument("split_sequential: stage " + std::to_string(stage) + " of " +
                          std::to_string(boundaries.size() + 1));
  const int64_t begin = stage == 0 ? 0 : boundaries[stage - 1];
  const int64_t end = stage == static_cast<int>(boundaries.size()) ? n : boundaries[stage];
  torch::nn::Sequential out;
  for (int64_t i = begin; i < end; ++i)
    out->push_back(std::to_string(i), *(model.ptr()->begin() + i));
  return out;
}

std::vector<int64_t> partition_balanced(const std::vector<double>& w, int k) {
  const int n = static_cast<int>(w.size());
  if (k < 1 || n < k)
    throw InvalidArgument("partition_balanced: cannot split " + std::to_string(n) +
                          " layers into " + std::to_string(k) + " non-empty stages");
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + w[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[j][i]: smallest largest-sum splitting the first i layers in j runs.
  std::vector<std::vector<double>> best(k + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(k + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int j = 1; j <= k; ++j)
    for (int i = j; i <= n; ++i)
      for (int c = j - 1; c < i; ++c) {
        double v = std::max(best[j - 1][c], prefix[i] - prefix[c]);
        if (v < best[j][i]) best[j][i] = v, cut[j][i] = c;
      }
  std::vector<int64_t> b(k - 1);
  for (int j = k, i = n; j > 1; --j) i = cut[j][i], b[j - 2] = i;
  return b;
}

std::vector<int64_t> balance_by_parameters(const torch::nn::Sequential& model, int num_stages) {
  std::vector<double> w;
  for (const auto& layer : *model) {
    double n = 0;
    for (const auto& p : layer.ptr()->parameters()) n += static_cast<double>(p.numel());
    w.push_back(n);
  }
  return partition_balanced(w, num_stages);
}

std::vector<int64_t> balance_by_time(const torch::nn::Sequential& model,
                                     const torch::Tensor& sample, int num_stages, int repeats) {
  using Clock = std::chrono::steady_clock;
  std::vector<double> w;
  torch::Tensor x = sample;
  for (auto& layer : *model.ptr()) {
    double best = std::numeric_limits<double>::infinity();
    torch::Tensor y;
    for (int r = 0; r < std::max(1, repeats); ++r) {
      auto in = x.detach().requires_grad_(x.is_floating_point());
      auto t0 = Clock::now();
      y = layer.forward(in);
      std::vector<torch::Tensor> wrt = trainable(layer.ptr()->parameters());
      if (in.requires_grad()) wrt.push_back(in);
      if (y.requires_grad() && !wrt.empty())
        torch::autograd::grad({y}, wrt, {torch::ones_like(y)}, false, false, true);
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    w.push_back(best);
    x = y.detach();
  }
  return partition_balanced(w, num_stages);
}

}  // namespace cohort::pipeline
