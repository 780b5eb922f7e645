// A Trainer with DDP and a stateful compressor, on a model whose gradients
// become ready in another order than reverse registration, one parameter
// per bucket: DDP's buckets are rebuilt after the first step, so the
// compressor's state (keyed by bucket index) describes the rebuilt layout.
// Resumed from a checkpoint, the run takes bitwise the steps of the
// uninterrupted one. A saved layout that does not fit the model, and
// compressor state saved without its layout, are refused on every rank.
#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <tuple>

#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "tests/train/train_fixtures.h"

namespace cohort::testing::compression_layout_resume_test {
namespace {

using compression::CompressionKind;

constexpr int64_t kMicro = 4;
constexpr int64_t kSteps = 4;

// `head` is registered first but applied last: its gradients are ready
// first, so the rebuilt buckets (ready order) differ from the first ones
// (reverse registration).
struct HeadFirstImpl : torch::nn::Module {
  HeadFirstImpl() {
    head = register_module("head", torch::nn::Linear(8, 4));
    body = register_module("body", torch::nn::Linear(8, 8));
    auto gen = make_generator(5);
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(torch::randn(p.sizes(), gen, torch::kFloat32) * 0.3);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::tanh(body(x))); }
  torch::nn::Linear head{nullptr}, body{nullptr};
};
TORCH_MODULE(HeadFirst);

DDPOptions options_of(CompressionKind kind) {
  DDPOptions o;
  o.bucket_cap_mb = o.first_bucket_mb = 1e-6;  // one parameter per bucket
  o.compression.kind = kind;
  o.compression.int8_chunk = 8;
  o.compression.topk_ratio = 0.2;
  o.compression.powersgd_start_iteration = 2;
  o.compression.powersgd_min_compression_rate = 1;
  return o;
}

// Trains steps [from, to) at `world` ranks (resuming from `dir` when
// from > 0, checkpointing at `to` when it is not the end) and returns
// rank 0's parameters and bucket layout.
struct Result {
  std::vector<torch::Tensor> params;
  std::vector<std::vector<size_t>> layout;
};
Result train(int world, CompressionKind kind, const std::string& dir, int64_t from, int64_t to,
             const Synthetic& data) {
  Result out;
  std::mutex mu;
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    HeadFirst net;
    DistributedDataParallel<HeadFirst> ddp(net, comm, options_of(kind));
    torch::optim::SGD sgd(ddp.parameters(), torch::optim::SGDOptions(0.1));
    TrainerOptions config;
    config.schedule.base_lr = 0.1;
    config.progress = false;
    config.checkpoint_dir = dir;
    LossFn loss = [&](const torch::data::Example<>& b) {
      return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
    };
    Trainer trainer(TrainerWiring::ddp(ddp, sgd), loss, config);
    if (from > 0) {
      ASSERT_EQ(trainer.resume().value_or(-1), from);
    }
    for (int64_t s = from; s < to; ++s) {
      const int64_t start = (s * world + comm->rank()) * kMicro;
      trainer.train_step({{data.x.narrow(0, start, kMicro), data.y.narrow(0, start, kMicro)}});
    }
    if (comm->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& p : net->parameters()) out.params.push_back(p.detach().clone());
      out.layout = ddp.reducer().bucket_layout();
    }
    if (to < kSteps) trainer.save_checkpoint();
  });
  return out;
}

class LayoutResume : public ::testing::TestWithParam<std::tuple<int, CompressionKind, int64_t>> {};

TEST_P(LayoutResume, BitwiseTheUninterruptedRun) {
  const auto [world, kind, at] = GetParam();
  const auto data = make_data(kSteps * world * kMicro);
  TempDir straight_dir("layout-straight"), resumed_dir("layout-resumed");
  const auto straight = train(world, kind, straight_dir.str(), 0, kSteps, data);
  train(world, kind, resumed_dir.str(), 0, at, data);
  // Reverse registration (body, then head) at first; head first after the rebuild.
  ASSERT_NE(straight.layout, (std::vector<std::vector<size_t>>{{3}, {2}, {1}, {0}}))
      << "no rebuild: the test proves nothing";
  const auto resumed = train(world, kind, resumed_dir.str(), at, kSteps, data);
  EXPECT_EQ(resumed.layout, straight.layout);
  ASSERT_EQ(resumed.params.size(), straight.params.size());
  for (size_t i = 0; i < straight.params.size(); ++i) {
    EXPECT_TRUE(torch::equal(resumed.params[i], straight.params[i]))
        << "parameter " << i << ": max |difference| "
        << (resumed.params[i] - straight.params[i]).abs().max().item<float>();
  }
}

// Checkpoints after the first step (rebuild still to come) and after the
// second (buckets rebuilt).
INSTANTIATE_TEST_SUITE_P(Compression, LayoutResume,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values(CompressionKind::Int8,
                                                              CompressionKind::TopK,
                                                              CompressionKind::PowerSGD),
                                            ::testing::Values(int64_t{1}, int64_t{2})),
                         [](const auto& info) {
                           return compression::to_string(std::get<1>(info.param)) + "_world" +
                                  std::to_string(std::get<0>(info.param)) + "_at" +
                                  std::to_string(std::get<2>(info.param));
                         });

// Rank r's DDPGradientSync state after two int8 steps (buckets rebuilt),
// changed by `edit`, handed back to the same rank's sync: each rank's
// ConfigError, empty where none, and whether the layout stayed.
std::vector<std::string> load_edited(
    int world, const std::function<void(std::map<std::string, torch::Tensor>&)>& edit) {
  std::vector<std::string> errors(world);
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    HeadFirst net;
    DistributedDataParallel<HeadFirst> ddp(net, comm, options_of(CompressionKind::Int8));
    DDPGradientSync<HeadFirst> sync(ddp);
    const auto data = make_data(world * kMicro);
    for (int step = 0; step < 2; ++step) {
      net->zero_grad();
      ddp.forward(data.x.narrow(0, comm->rank() * kMicro, kMicro)).sum().backward();
    }
    auto state = sync.state();
    edit(state);
    const auto layout = ddp.reducer().bucket_layout();
    try {
      sync.load_state(state);
    } catch (const ConfigError& e) {
      errors[comm->rank()] = e.what();
    }
    EXPECT_EQ(ddp.reducer().bucket_layout(), layout);
  });
  return errors;
}

// State written before the layout was saved with it cannot be placed.
TEST(LayoutResumeRefusal, HookStateWithoutItsLayoutOnEveryRank) {
  const auto errors = load_edited(2, [](auto& state) {
    for (auto it = state.begin(); it != state.end();) {
      it = it->first.rfind("ddp_layout", 0) == 0 ? state.erase(it) : std::next(it);
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("DistributedDataParallel on rank " + std::to_string(r)),
              std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("without the bucket layout it is keyed by"), std::string::npos)
        << errors[r];
  }
}

TEST(LayoutResumeRefusal, LayoutThatDoesNotFitOnEveryRank) {
  for (const auto& [what, edit] :
       std::vector<std::pair<std::string, std::function<void(torch::Tensor&)>>>{
           {"not a permutation", [](torch::Tensor& p) { p[0] = p[1].item<int64_t>(); }},
           {"not a permutation", [](torch::Tensor& p) { p = p.narrow(0, 0, 3).clone(); }},
           {"not a permutation", [](torch::Tensor& p) { p[0] = 4; }}}) {
    const auto errors = load_edited(2, [&](auto& state) { edit(state.at("ddp_layout_params")); });
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find("DistributedDataParallel on rank " + std::to_string(r) +
                               ": the bucket layout saved with the comm hook's state does not "
                               "fit this model's 4 parameters"),
                std::string::npos)
          << errors[r];
      EXPECT_NE(errors[r].find(what), std::string::npos) << errors[r];
    }
  }
}

// Through the Trainer: a model whose head is frozen has two parameters for
// DDP, not the four the saved layout holds; refused on every rank before
// anything is loaded.
TEST(LayoutResumeRefusal, ThroughTheTrainerBeforeAnythingIsLoaded) {
  constexpr int kWorld = 2;
  const auto data = make_data(kSteps * kWorld * kMicro);
  TempDir dir("layout-misfit");
  train(kWorld, CompressionKind::Int8, dir.str(), 0, 2, data);
  std::vector<std::string> errors(kWorld);
  run_ranks_shared(kWorld, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    HeadFirst net;
    for (auto& p : net->head->parameters()) p.set_requires_grad(false);
    DistributedDataParallel<HeadFirst> ddp(net, comm, options_of(CompressionKind::Int8));
    torch::optim::SGD sgd(ddp.parameters(), torch::optim::SGDOptions(0.1));
    TrainerOptions config;
    config.progress = false;
    config.checkpoint_dir = dir.str();
    LossFn loss = [&](const torch::data::Example<>& b) {
      return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
    };
    Trainer trainer(TrainerWiring::ddp(ddp, sgd), loss, config);
    std::vector<torch::Tensor> before;
    for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
    const auto layout = ddp.reducer().bucket_layout();
    try {
      trainer.resume();
    } catch (const ConfigError& e) {
      errors[comm->rank()] = e.what();
    }
    EXPECT_EQ(ddp.reducer().bucket_layout(), layout);
    for (size_t i = 0; i < before.size(); ++i) {
      EXPECT_TRUE(torch::equal(net->parameters()[i], before[i])) << "parameter " << i;
    }
  });
  // The load's agreement gives every rank the first failing rank's message.
  for (const auto& e : errors) {
    EXPECT_NE(e.find("DistributedDataParallel on rank 0: the bucket layout saved with the comm "
                     "hook's state does not fit this model's 2 parameters"),
              std::string::npos)
        << e;
  }
}

}  // namespace
}  // namespace cohort::testing::compression_layout_resume_test
