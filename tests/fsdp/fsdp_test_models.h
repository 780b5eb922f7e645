// defines: the models, batches and comparisons the FSDP tests share.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"

namespace cohort::testing::fsdp_test {

using torch::nn::AnyModule;
using torch::nn::Linear;
using torch::nn::Sequential;
using torch::nn::Tanh;
using Named = torch::OrderedDict<std::string, torch::Tensor>;

inline constexpr int kSteps = 10;
inline constexpr int64_t kBatch = 12;  // divides by 1, 2, 3 and 4

// The engines ranks as threads run on: Gloo, and UCX where it is built.
inline std::vector<std::string> thread_backends() {
  std::vector<std::string> out = {"gloo"};
#ifdef COHORT_WITH_UCX
  out.push_back("ucx");
#endif
  return out;
}

// Deterministic values for every parameter, without the global generator
// (ranks are threads).
inline void init_parameters(torch::nn::Module& m, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.5);
}

// A weight used by two layers: x @ w on the way in, h @ w^T on the way out.
struct InProjImpl : torch::nn::Module {
  torch::Tensor w;
  explicit InProjImpl(torch::Tensor shared) { w = register_parameter("w", shared); }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(w); }
};
TORCH_MODULE(InProj);
struct OutProjImpl : torch::nn::Module {
  torch::Tensor w;
  explicit OutProjImpl(torch::Tensor shared) { w = register_parameter("w", shared); }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(w.t()); }
};
TORCH_MODULE(OutProj);

// The model: units of 7 and 6 rows (neither divides by 2, 4), a root-held
// weight tied between the first and last layer, a root-held bias layer of
// 5 rows. `wrap`: each Linear becomes a unit (comm given) or stays plain.
inline Sequential make_model(const std::shared_ptr<Communicator>& comm, FullyShardOptions options) {
  auto tied = torch::zeros({5, 7});
  auto unit = [&](torch::nn::AnyModule m) {
    if (!comm) return m;
    return AnyModule(FullyShard(m, comm, options));
  };
  Sequential seq;
  seq->push_back(InProj(tied));
  seq->push_back(Tanh());
  seq->push_back(unit(AnyModule(Linear(7, 6))));
  seq->push_back(Tanh());
  seq->push_back(unit(AnyModule(Linear(6, 7))));
  seq->push_back(Tanh());
  seq->push_back(OutProj(tied));
  seq->push_back(Linear(5, 5));
  return seq;
}

struct Batches {
  std::vector<torch::Tensor> x, y;
};

inline Batches make_batches(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Batches b;
  for (int s = 0; s < kSteps; ++s) {
    b.x.push_back(torch::randn({kBatch, 5}, gen));
    b.y.push_back(torch::randn({kBatch, 5}, gen));
  }
  return b;
}

inline void expect_close(const Named& got, const Named& expected, double rel,
                         const std::string& what) {
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (const auto& e : expected) {
    const auto* g = got.find(e.key());
    ASSERT_NE(g, nullptr) << what << ": " << e.key();
    ASSERT_EQ(g->sizes(), e.value().sizes()) << what << ": " << e.key();
    const double scale = std::max(e.value().abs().max().item<double>(), 1e-30);
    const double err = (*g - e.value()).abs().max().item<double>();
    EXPECT_LE(err, rel * scale) << what << ": " << e.key() << " differs by " << err / scale;
  }
}

// This rank's rows of the global batch.
inline torch::Tensor local(const torch::Tensor& global, const Communicator& comm) {
  const int64_t n = global.size(0) / comm.size();
  return global.narrow(0, comm.rank() * n, n);
}

// Loads `twin`'s parameters and buffers (a bare model with the same names)
// into the sharded `model`.
inline void load_from(FullyShard& model, torch::nn::Module& twin) {
  Named full;
  for (const auto& p : twin.named_parameters()) full.insert(p.key(), p.value());
  for (const auto& b : twin.named_buffers()) full.insert(b.key(), b.value());
  model->load_full_state_dict(full);
}

}  // namespace cohort::testing::fsdp_test
