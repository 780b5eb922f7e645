// defines: the models, batches and comparisons the FSDP tests share. The
// models, batches and one-process references live on test_device().
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "tests/support/test_device.h"

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
// 5 rows. `unit` makes each Linear a unit, or leaves it plain. Every layer
// is on test_device() before it is wrapped: a unit shards what it holds then.
inline Sequential make_model_with(const std::function<AnyModule(AnyModule)>& unit) {
  auto on_device = [](Linear l) {
    l->to(test_device());
    return l;
  };
  auto tied = torch::zeros({5, 7}, test_device());
  Sequential seq;
  seq->push_back(InProj(tied));
  seq->push_back(Tanh());
  seq->push_back(unit(AnyModule(on_device(Linear(7, 6)))));
  seq->push_back(Tanh());
  seq->push_back(unit(AnyModule(on_device(Linear(6, 7)))));
  seq->push_back(Tanh());
  seq->push_back(OutProj(tied));
  seq->push_back(on_device(Linear(5, 5)));
  return seq;
}

// The model with units over `comm` (null: plain).
inline Sequential make_model(const std::shared_ptr<Communicator>& comm, FullyShardOptions options) {
  return make_model_with([&](AnyModule m) {
    if (!comm) return m;
    return AnyModule(FullyShard(m, comm, options));
  });
}

// The model with units over `mesh`.
inline Sequential make_model(const DeviceMesh& mesh, FullyShardOptions options) {
  return make_model_with([&](AnyModule m) { return AnyModule(FullyShard(m, mesh, options)); });
}

struct Batches {
  std::vector<torch::Tensor> x, y;
};

inline Batches make_batches(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Batches b;
  for (int s = 0; s < kSteps; ++s) {
    b.x.push_back(torch::randn({kBatch, 5}, gen).to(test_device()));
    b.y.push_back(torch::randn({kBatch, 5}, gen).to(test_device()));
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

// The largest difference of a tensor of `got` from `expected`'s, relative to
// the largest magnitude of `expected`'s tensor.
inline double max_relative_error(const Named& got, const Named& expected) {
  double worst = 0;
  for (const auto& e : expected) {
    const auto* g = got.find(e.key());
    if (!g || g->sizes() != e.value().sizes()) return INFINITY;
    const double scale = std::max(e.value().abs().max().item<double>(), 1e-30);
    worst = std::max(worst, (*g - e.value()).abs().max().item<double>() / scale);
  }
  return worst;
}

// A detached copy of every parameter of `m`, by name.
inline Named parameters_of(const torch::nn::Module& m) {
  Named out;
  for (const auto& p : m.named_parameters()) out.insert(p.key(), p.value().detach().clone());
  return out;
}

// Each rank's state at the end of a run of ranks as threads.
class RankStates {
 public:
  void keep(int rank, Named state) {
    std::lock_guard<std::mutex> lock(mu_);
    states_[rank] = std::move(state);
  }
  // Every rank's state within `rel` of `want` (see expect_close).
  void expect_close_to(const Named& want, double rel) const {
    for (const auto& [rank, state] : states_) {
      expect_close(state, want, rel, "rank " + std::to_string(rank));
    }
  }

 private:
  std::mutex mu_;
  std::map<int, Named> states_;
};

enum class Opt { AdamW, SGD };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt,
                                                               std::vector<torch::Tensor> params) {
  if (opt == Opt::AdamW) {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
}

// The model trained by one process on the whole batch for kSteps steps,
// step `skipped` left out (-1: none).
inline Named reference(Opt opt, const Batches& b, int skipped = -1) {
  auto model = make_model(nullptr, {});
  init_parameters(*model, 7);
  auto optimizer = make_optimizer(opt, model->parameters());
  for (int s = 0; s < kSteps; ++s) {
    if (s == skipped) continue;
    optimizer->zero_grad();
    torch::mse_loss(model->forward(b.x[s]), b.y[s]).backward();
    optimizer->step();
  }
  return parameters_of(*model);
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

// kSteps steps on this rank's rows of each batch, in `micro_batches`
// micro-batches whose gradients are synchronized on the last.
inline void train_steps(FullyShard& model, torch::optim::Optimizer& optimizer, const Batches& b,
                        const Communicator& comm, int micro_batches) {
  for (int s = 0; s < kSteps; ++s) {
    optimizer.zero_grad();
    auto x = local(b.x[s], comm), y = local(b.y[s], comm);
    const int64_t n = x.size(0) / micro_batches;
    for (int m = 0; m < micro_batches; ++m) {
      model->set_requires_gradient_sync(m + 1 == micro_batches);
      auto loss = torch::mse_loss(model->forward(x.narrow(0, m * n, n)), y.narrow(0, m * n, n));
      (loss / micro_batches).backward();
    }
    optimizer.step();
  }
}

}  // namespace cohort::testing::fsdp_test
