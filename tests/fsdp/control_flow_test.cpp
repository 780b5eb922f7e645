// Control flow inside a fully sharded model under gradient accumulation,
// ranks as threads over Gloo and UCX at worlds 1 to 3, every unit made
// with reshard_after_forward true or false: a unit called twice in one
// forward (its weight reused), a unit called on one micro-batch of a step
// and not the other, and parameters frozen or unfrozen between the
// micro-batches of a step (the first micro-batch without gradient sync,
// the second with it). After 10 AdamW steps every parameter equals that of
// one process running the same micro-batches on the whole batch, within
// 1e-6 relative.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>

#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::control_flow_test {
namespace {

using namespace fsdp_test;

constexpr int kMicro = 2;

// in (the root's), tanh, `twice` called twice, `side` added on the
// micro-batches that ask for it, out (the root's). Units when built with a
// communicator.
struct FlowImpl : torch::nn::Module {
  Linear in{nullptr}, out{nullptr}, twice_bare{nullptr}, side_bare{nullptr};
  AnyModule twice, side;
  bool use_side = true;
  FlowImpl(const std::shared_ptr<Communicator>& comm, FullyShardOptions options) {
    in = register_module("in", Linear(5, 6));
    twice_bare = Linear(6, 6);
    side_bare = Linear(6, 6);
    auto unit = [&](Linear l) {
      return comm ? AnyModule(FullyShard(AnyModule(l), comm, options)) : AnyModule(l);
    };
    twice = unit(twice_bare);
    side = unit(side_bare);
    register_module("twice", twice.ptr());
    register_module("side", side.ptr());
    out = register_module("out", Linear(6, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(in(x));
    h = torch::tanh(twice.forward(h));
    h = torch::tanh(twice.forward(h));
    if (use_side) h = h + torch::tanh(side.forward(h));
    return out(h);
  }
};
TORCH_MODULE(Flow);

// Step s, micro-batch m: whether the side unit runs, and which parameters
// train (the others are frozen for that micro-batch).
void configure(FlowImpl& f, int s, int m) {
  f.use_side = !(s % 3 == 1 && m == 0);
  f.twice_bare->bias.set_requires_grad(!(s % 4 == 2 && m == 0));
  f.twice_bare->weight.set_requires_grad(!(s % 4 == 3 && m == 1));
  f.side_bare->weight.set_requires_grad(!(s % 5 == 4 && m == 1));
}

// Rows of micro-batch m of every rank's slice: what `world` ranks run
// together in that micro-batch.
torch::Tensor micro_rows(const torch::Tensor& global, int world, int m) {
  const int64_t slice = global.size(0) / world, n = slice / kMicro;
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < world; ++r) parts.push_back(global.narrow(0, r * slice + m * n, n));
  return torch::cat(parts);
}

Named reference(const Batches& b, int world) {
  auto model = Flow(std::shared_ptr<Communicator>(), FullyShardOptions{});
  init_parameters(*model, 3);
  auto opt = make_optimizer(Opt::AdamW, model->parameters());
  for (int s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    for (int m = 0; m < kMicro; ++m) {
      configure(*model, s, m);
      auto x = micro_rows(b.x[s], world, m), y = micro_rows(b.y[s], world, m);
      (torch::mse_loss(model->forward(x), y) / kMicro).backward();
    }
    opt->step();
  }
  return parameters_of(*model);
}

class FSDPControlFlow : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(FSDPControlFlow, ReuseSkippedUnitsAndFreezingBetweenMicroBatchesTrainAsOneProcess) {
  const auto c = GetParam();
  const auto b = make_batches(23);
  const auto want = reference(b, c.world);
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward true" : "reshard_after_forward false");
    RankStates got;
    run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          FullyShardOptions options;
          options.reshard_after_forward = reshard;
          auto bare = Flow(comm, options);
          auto model = fully_shard(AnyModule(bare), comm, options);
          auto twin = Flow(std::shared_ptr<Communicator>(), FullyShardOptions{});
          init_parameters(*twin, 3);
          load_from(model, *twin);
          auto opt = make_optimizer(Opt::AdamW, model->parameters());
          for (int s = 0; s < kSteps; ++s) {
            opt->zero_grad();
            auto x = local(b.x[s], *comm), y = local(b.y[s], *comm);
            const int64_t n = x.size(0) / kMicro;
            for (int m = 0; m < kMicro; ++m) {
              configure(*bare, s, m);
              model->set_requires_gradient_sync(m + 1 == kMicro);
              auto out = model->forward(x.narrow(0, m * n, n));
              (torch::mse_loss(out, y.narrow(0, m * n, n)) / kMicro).backward();
            }
            opt->step();
          }
          got.keep(comm->rank(), model->full_state_dict());
        },
        options_for(c));
    got.expect_close_to(want, 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPControlFlow, ::testing::ValuesIn(engine_worlds({1, 2, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::control_flow_test
