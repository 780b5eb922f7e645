// defines: the small models the pipeline tests run, with deterministic
// (thread-safe, seed-free) parameters, and their one-process reference.
#pragma once

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include <vector>

#include "cohort/pipeline/pipeline_stage.h"

namespace cohort::pipeline::testing {

constexpr int64_t kWidth = 6;

// A deterministic tensor: sin over a scaled range (no random generator, so
// that ranks on threads build identical models without a global seed).
inline torch::Tensor det(std::vector<int64_t> shape, double phase) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return torch::sin(torch::arange(n, torch::kFloat32) * 0.37 + phase).reshape(shape) * 0.5;
}

// `stages` blocks of (Linear, Tanh): two layers per stage, on `device`.
inline torch::nn::Sequential make_mlp(int stages, torch::Device device = torch::kCPU) {
  torch::nn::Sequential seq;
  torch::NoGradGuard no_grad;
  for (int s = 0; s < stages; ++s) {
    torch::nn::Linear lin(kWidth, kWidth);
    lin->weight.copy_(det({kWidth, kWidth}, s));
    lin->bias.copy_(det({kWidth}, 10 + s));
    seq->push_back(lin);
    seq->push_back(torch::nn::Tanh());
  }
  seq->to(device);
  return seq;
}

inline std::vector<int64_t> mlp_boundaries(int stages) {
  std::vector<int64_t> b;
  for (int s = 1; s < stages; ++s) b.push_back(2 * s);
  return b;
}

inline torch::Tensor mse(const Tensors& out, const Tensors& target) {
  return torch::nn::functional::mse_loss(out[0], target[0]);
}

struct Reference {
  std::vector<double> losses;        // per micro-batch
  std::vector<torch::Tensor> grads;  // model->parameters() order
};

// The whole batch in one process, on x's device: the mean loss, its
// gradients, and each micro-batch's loss.
inline Reference reference_run(int stages, const torch::Tensor& x, const torch::Tensor& y, int m) {
  auto model = make_mlp(stages, x.device());
  auto loss = torch::nn::functional::mse_loss(model->forward(x), y);
  loss.backward();
  Reference r;
  for (const auto& p : model->parameters()) r.grads.push_back(p.grad().clone());
  torch::NoGradGuard no_grad;
  auto xs = x.chunk(m), ys = y.chunk(m);
  for (int i = 0; i < m; ++i)
    r.losses.push_back(
        torch::nn::functional::mse_loss(model->forward(xs[i]), ys[i]).item<double>());
  return r;
}

// A model of `stages` stages with one weight W [kWidth, kWidth] used by the
// first, the last and, from three stages on, the second stage (a tied
// embedding and output layer, and one more use):
//   first: h = tanh(x W^T);  second: h = tanh(h W + b);  others: tanh(h A^T + b);
//   last: out = h W (with one stage: out = tanh(x W^T) W).
// `TiedParams` holds one stage's tensors; the one-process reference passes
// the same W to every stage.
struct TiedParams {
  torch::Tensor w, a, b;
};

inline bool uses_tied(int s, int stages) {
  return s == 0 || s == stages - 1 || (s == 1 && stages >= 3);
}

// Stage s's tensors, each requiring grad; its W starts at the reference's
// plus `offset` * s (a copy a process built on its own, which the runtime
// must make equal to stage 0's).
inline TiedParams tied_params(int s, int stages, double offset = 0) {
  TiedParams p;
  if (uses_tied(s, stages)) p.w = (det({kWidth, kWidth}, 2.0) + offset * s).requires_grad_(true);
  if (s > 0 && s < stages - 1) p.b = det({kWidth}, 5.0 + s).requires_grad_(true);
  if (s > 1 && s < stages - 1) p.a = det({kWidth, kWidth}, 3.0 + s).requires_grad_(true);
  return p;
}

inline std::vector<torch::Tensor> tied_stage_parameters(const TiedParams& p) {
  std::vector<torch::Tensor> out;
  for (const auto& t : {p.w, p.a, p.b})
    if (t.defined()) out.push_back(t);
  return out;
}

inline torch::Tensor tied_forward(int s, int stages, torch::Tensor h, const TiedParams& p) {
  if (s == 0)
    h = torch::tanh(h.matmul(p.w.t()));
  else if (s == 1 && stages >= 3)
    h = torch::tanh(h.matmul(p.w) + p.b);
  else if (s < stages - 1)
    h = torch::tanh(h.matmul(p.a.t()) + p.b);
  return s == stages - 1 ? h.matmul(p.w) : h;
}

// Stage s with its own tensors, its W declared tied as "w".
inline PipelineStage tied_stage(int s, int stages, double offset = 0) {
  const TiedParams p = tied_params(s, stages, offset);
  PipelineStage stage(
      s, [s, stages, p](const Tensors& in) { return Tensors{tied_forward(s, stages, in[0], p)}; },
      tied_stage_parameters(p));
  if (p.w.defined()) stage.tie("w", p.w);
  return stage;
}

// The unsplit model: one W for every stage, the other tensors per stage.
struct TiedReference {
  torch::Tensor w;
  std::vector<TiedParams> stage;
  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> out{w};
    for (const auto& p : stage) {
      for (const auto& t : {p.a, p.b})
        if (t.defined()) out.push_back(t);
    }
    return out;
  }
  torch::Tensor forward(torch::Tensor x) const {
    for (size_t s = 0; s < stage.size(); ++s) {
      TiedParams p = stage[s];
      p.w = w;
      x = tied_forward(static_cast<int>(s), static_cast<int>(stage.size()), x, p);
    }
    return x;
  }
};

inline TiedReference tied_reference(int stages) {
  TiedReference r;
  r.w = det({kWidth, kWidth}, 2.0).requires_grad_(true);
  for (int s = 0; s < stages; ++s) {
    r.stage.push_back(tied_params(s, stages));
    r.stage.back().w = torch::Tensor();
  }
  return r;
}

}  // namespace cohort::pipeline::testing
