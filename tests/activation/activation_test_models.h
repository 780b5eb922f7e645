// defines: the models the checkpointing tests run (an MLP, a pre-LayerNorm
// transformer block with dropout, a stack of them), with parameters drawn
// from a private generator (ranks on threads build identical models without
// touching the global seed), and helpers to take and compare gradients.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

namespace cohort::testing {

// Every parameter from N(0, 0.2^2), drawn from `seed`; LayerNorm weights 1.
inline void init_parameters(torch::nn::Module& m, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& p : m.named_parameters()) {
    if (p.key().find("norm") != std::string::npos && p.key().find("weight") != std::string::npos)
      p.value().fill_(1.0);
    else
      p.value().copy_(torch::randn(p.value().sizes(), gen) * 0.2);
  }
}

// `blocks` of (Linear, Tanh), width -> width.
inline torch::nn::Sequential make_mlp(int blocks, int64_t width, uint64_t seed = 3) {
  torch::nn::Sequential seq;
  for (int b = 0; b < blocks; ++b) {
    seq->push_back(torch::nn::Linear(width, width));
    seq->push_back(torch::nn::Tanh());
  }
  init_parameters(*seq, seed);
  return seq;
}

// x [B, T, H] -> x + drop(attn(norm1(x))) -> h + drop(mlp(norm2(h))), causal
// attention with dropout on its probabilities: every kind of saved
// activation a GPT block has.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t hidden, int64_t heads, double dropout) : heads_(heads), dropout_(dropout) {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
    norm2 = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({hidden})));
    qkv = register_module("qkv", torch::nn::Linear(hidden, 3 * hidden));
    proj = register_module("proj", torch::nn::Linear(hidden, hidden));
    fc1 = register_module("fc1", torch::nn::Linear(hidden, 4 * hidden));
    fc2 = register_module("fc2", torch::nn::Linear(4 * hidden, hidden));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = x + drop(proj(attention(qkv(norm1(x)))));
    return h + drop(fc2(torch::gelu(fc1(norm2(h)))));
  }
  torch::Tensor attention(const torch::Tensor& qkv_out) {
    const auto B = qkv_out.size(0), T = qkv_out.size(1), H = qkv_out.size(2) / 3;
    const auto hd = H / heads_;
    auto parts = qkv_out.view({B, T, 3, heads_, hd}).permute({2, 0, 3, 1, 4});  // 3, B, h, T, hd
    auto scores = torch::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(double(hd));
    auto future = torch::ones({T, T}, torch::kBool).triu(1);
    auto probs = drop(torch::softmax(scores.masked_fill(future, -1e9), -1));
    return torch::matmul(probs, parts[2]).transpose(1, 2).reshape({B, T, H});
  }
  torch::Tensor drop(const torch::Tensor& x) {
    return dropout_ > 0 ? torch::dropout(x, dropout_, is_training()) : x;
  }
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
  int64_t heads_;
  double dropout_;
};
TORCH_MODULE(Block);

inline torch::nn::Sequential make_transformer(int blocks, int64_t hidden, int64_t heads,
                                              double dropout, uint64_t seed = 5) {
  torch::nn::Sequential seq;
  for (int b = 0; b < blocks; ++b) seq->push_back(Block(hidden, heads, dropout));
  init_parameters(*seq, seed);
  return seq;
}

// A fixed, non-uniform weighting of the output, so that every output
// element's gradient differs (a plain sum would hide permutations).
inline torch::Tensor weighted_loss(const torch::Tensor& y) {
  auto w = torch::sin(torch::arange(y.numel(), y.options()) * 0.7).reshape(y.sizes());
  return (y * w).sum();
}

// The gradients of `params` (cloned; undefined stays undefined) and clears them.
inline std::vector<torch::Tensor> take_grads(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (auto p : params) {
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    p.mutable_grad() = torch::Tensor();
  }
  return out;
}

// Bitwise equality of two gradient lists, naming the first that differs.
inline ::testing::AssertionResult bitwise_equal(const std::vector<torch::Tensor>& a,
                                                const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << a.size() << " gradients against " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined())
      return ::testing::AssertionFailure() << "gradient " << i << " defined on one side only";
    if (a[i].defined() && !torch::equal(a[i], b[i]))
      return ::testing::AssertionFailure() << "gradient " << i << " differs by up to "
                                           << (a[i] - b[i]).abs().max().item<double>();
  }
  return ::testing::AssertionSuccess();
}

}  // namespace cohort::testing
