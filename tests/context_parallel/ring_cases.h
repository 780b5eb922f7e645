// defines: what the ring attention tests share: the engines ranks as threads
// run on, deterministic inputs, the one-process reference (full causal
// attention in plain LibTorch ops) and a run of ring_attention on every rank
// gathered back into full order.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/context_parallel/layout.h"
#include "cohort/context_parallel/ring_attention.h"
#include "support/thread_ranks.h"

namespace cohort::testing::ring_cases {

using context_parallel::RingAttentionOptions;

// The engines ranks as threads run on: UCX where it is built, and Gloo.
inline std::vector<std::string> engines() {
  std::vector<std::string> out;
#ifdef COHORT_WITH_UCX
  out.push_back("ucx");
#endif
  out.push_back("gloo");
  return out;
}

inline ThreadRanksOptions on(const std::string& engine) {
  ThreadRanksOptions o;
  o.backend = engine;
  return o;
}

// q, k, v and the weights of the loss sum(out * w), all [B, H, S, D].
struct Inputs {
  torch::Tensor q, k, v, w;
};

inline Inputs make_inputs(int64_t batch, int64_t heads, int64_t length, int64_t dim) {
  auto gen = at::detail::createCPUGenerator(1000 + length);
  auto draw = [&] { return torch::randn({batch, heads, length, dim}, gen); };
  Inputs in;
  in.q = draw();
  in.k = draw();
  in.v = draw();
  in.w = draw();
  return in;
}

// Output and gradients of q, k, v, in full sequence order.
struct Result {
  torch::Tensor out, dq, dk, dv;
};

// Full causal attention on one process, in plain LibTorch ops.
inline Result reference(const Inputs& in) {
  auto q = in.q.clone().requires_grad_(), k = in.k.clone().requires_grad_(),
       v = in.v.clone().requires_grad_();
  const int64_t s = q.size(2);
  auto scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  auto future = torch::ones({s, s}, torch::kBool).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  auto out = torch::softmax(scores, -1).matmul(v);
  (out * in.w).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// ring_attention on cp ranks (threads over `engine`), each holding its
// zig-zag shard; the results unsharded.
inline Result ring(const Inputs& in, int cp, const std::string& engine,
                   const RingAttentionOptions& options = {}) {
  using context_parallel::shard_sequence;
  std::vector<Result> parts(static_cast<size_t>(cp));
  run_ranks_shared(
      cp,
      [&](std::shared_ptr<Communicator> g) {
        torch::set_num_threads(1);
        const int r = g->rank();
        auto q = shard_sequence(in.q, r, cp).requires_grad_();
        auto k = shard_sequence(in.k, r, cp).requires_grad_();
        auto v = shard_sequence(in.v, r, cp).requires_grad_();
        // The mesh form here; memory_test and errors_test call the group form.
        auto out =
            context_parallel::ring_attention(q, k, v, DeviceMesh::from_group(g, "cp"), options);
        (out * shard_sequence(in.w, r, cp)).sum().backward();
        parts[static_cast<size_t>(r)] = {out.detach(), q.grad(), k.grad(), v.grad()};
      },
      on(engine));
  auto gather = [&](torch::Tensor Result::*field) {
    std::vector<torch::Tensor> shards;
    for (const auto& p : parts) shards.push_back(p.*field);
    return context_parallel::unshard_sequence(shards);
  };
  return {gather(&Result::out), gather(&Result::dq), gather(&Result::dk), gather(&Result::dv)};
}

inline double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

}  // namespace cohort::testing::ring_cases
