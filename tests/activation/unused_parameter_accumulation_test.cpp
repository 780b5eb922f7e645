// The checkpointed block's branch under gradient accumulation: two
// micro-batches a step, the first without gradient sync (DDP's and ZeRO-2's
// no_sync(), fully_shard's set_requires_gradient_sync(false); ZeRO-1, the
// fused optimizer and AllReduceGradientSync reduce at the step anyway).
// After step 0 the branch's parameter takes part in the first micro-batch
// only, on no rank, on rank 0 or on every rank, so the synchronizing
// backward runs its accumulator without a gradient while .grad may hold the
// first micro-batch's. It must be reduced where any rank has one (zeros for
// the others) and stay undefined where none has, as one process's AdamW
// sees it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/plan/gradient_sync.h"
#include "support/thread_ranks.h"
#include "tests/activation/gate_model.h"

namespace cohort::testing::unused_parameter_accumulation_test {
namespace {

using namespace gate;

constexpr int kSteps = 3;
constexpr int kMicro = 2;  // micro-batch 0 without sync, 1 with

// Who uses b after step 0, in micro-batch 0 only (step 0: everyone, both).
enum class Usage { Nowhere, Rank0, Every };
bool uses_b(Usage usage, int step, int micro, int rank) {
  if (step == 0) return true;
  return micro == 0 && (usage == Usage::Every || (usage == Usage::Rank0 && rank == 0));
}

// One process, no checkpointing: each micro-batch's loss is the mean of the
// ranks' losses, their gradients summed in .grad over the step.
Tensors reference(Usage usage, int world) {
  bool use_b = true;
  auto model = make_model(&use_b, false);
  torch::optim::AdamW opt(model->parameters(), kAdamW);
  for (int s = 0; s < kSteps; ++s) {
    model->zero_grad(/*set_to_none=*/true);
    for (int m = 0; m < kMicro; ++m) {
      torch::Tensor loss = torch::zeros({});
      for (int r = 0; r < world; ++r) {
        use_b = uses_b(usage, s, m, r);
        loss = loss + torch::mse_loss(model->forward(rows(inputs(kMicro * s + m, world), r)),
                                      rows(targets(kMicro * s + m, world), r));
      }
      (loss / world).backward();
    }
    opt.step();
  }
  return values(model->parameters());
}

struct Case {
  Engine engine;
  int world;
  Usage usage;
};

using Body = std::function<void()>;
// Runs a micro-batch's forward and backward, without sync when asked.
using Scope = std::function<void(bool no_sync, const Body&)>;
using Forward = std::function<torch::Tensor(const torch::Tensor&)>;

void train(const Case& c, int rank, bool* use_b, const Forward& forward, const Scope& scope,
           const Body& zero_grad, const Body& step) {
  for (int s = 0; s < kSteps; ++s) {
    zero_grad();
    for (int m = 0; m < kMicro; ++m) {
      *use_b = uses_b(c.usage, s, m, rank);
      const int k = kMicro * s + m;
      scope(m == 0, [&] {
        torch::mse_loss(forward(rows(inputs(k, c.world), rank)), rows(targets(k, c.world), rank))
            .backward();
      });
    }
    step();
  }
}

void plain(bool, const Body& body) { body(); }

Tensors sharded(const Case& c, const std::shared_ptr<Communicator>& comm) {
  bool use_b = true;
  const auto mesh = c.engine == Engine::Hsdp
                        ? init_device_mesh(comm, {c.world, 1}, {"replicate", "shard"})
                        : DeviceMesh::from_group(comm, "shard");
  auto model =
      c.engine == Engine::FsdpRoot
          ? fully_shard(make_model(&use_b, true), mesh)
          : fully_shard(checkpoint_blocks(shard_blocks(make_model(&use_b, false), mesh)), mesh);
  torch::optim::AdamW opt(model->parameters(), kAdamW);
  train(
      c, comm->rank(), &use_b, [&](const torch::Tensor& x) { return model->forward(x); },
      [&](bool no_sync, const Body& body) {
        model->set_requires_gradient_sync(!no_sync);
        body();
      },
      [&] { model->zero_grad(/*set_to_none=*/true); }, [&] { opt.step(); });
  Tensors out;
  for (const auto& p : model->full_state_dict()) out.push_back(p.value().clone());
  return out;
}

Tensors with_ddp(const Case& c, const std::shared_ptr<Communicator>& comm) {
  bool use_b = true;
  auto model = make_model(&use_b, true);
  DDPOptions options;
  options.find_unused_parameters = true;
  DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
  auto forward = [&](const torch::Tensor& x) { return ddp.forward(x); };
  auto scope = [&](bool no_sync, const Body& body) {
    if (!no_sync) return body();
    auto guard = ddp.no_sync();
    body();
  };
  if (c.engine == Engine::Ddp) {
    torch::optim::AdamW opt(ddp.parameters(), kAdamW);
    train(
        c, comm->rank(), &use_b, forward, scope, [&] { ddp.zero_grad(/*set_to_none=*/true); },
        [&] { opt.step(); });
  } else {
    ZeroOptions zo;
    zo.stage = 2;
    auto opt = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kAdamW, zo);
    train(
        c, comm->rank(), &use_b, forward, scope, [&] { opt->zero_grad(/*set_to_none=*/true); },
        [&] { opt->step(); });
  }
  return values(model->parameters());
}

Tensors distributed(const Case& c, const std::shared_ptr<Communicator>& comm) {
  torch::set_num_threads(1);
  if (sharded_engine(c.engine)) return sharded(c, comm);
  if (c.engine == Engine::Ddp || c.engine == Engine::DdpZero2) return with_ddp(c, comm);
  const int r = comm->rank();
  bool use_b = true;
  auto model = make_model(&use_b, true);
  auto forward = [&](const torch::Tensor& x) { return model->forward(x); };
  if (c.engine == Engine::Zero1 || c.engine == Engine::Zero2) {
    ZeroOptions zo;
    zo.stage = c.engine == Engine::Zero1 ? 1 : 2;
    auto opt =
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(model->parameters(), comm, kAdamW, zo);
    auto scope = [&](bool no_sync, const Body& body) {
      if (!no_sync) return body();
      auto guard = opt->no_sync();  // stage 1: no effect
      body();
    };
    train(
        c, r, &use_b, forward, scope, [&] { opt->zero_grad(/*set_to_none=*/true); },
        [&] { opt->step(); });
  } else if (c.engine == Engine::Fused) {
    FusedDistributedOptimizer opt(model->parameters(), comm, kAdamW);
    train(
        c, r, &use_b, forward, plain, [&] { opt.zero_grad(/*set_to_none=*/true); },
        [&] { opt.step(); });
  } else {
    AllReduceGradientSync sync(comm, model->parameters());
    torch::optim::AdamW opt(model->parameters(), kAdamW);
    train(
        c, r, &use_b, forward, plain, [&] { model->zero_grad(/*set_to_none=*/true); },
        [&] {
          sync.finish_sync();
          opt.step();
        });
  }
  return values(model->parameters());
}

class CheckpointUnusedParameterAccumulation : public ::testing::TestWithParam<Case> {};

TEST_P(CheckpointUnusedParameterAccumulation, StepsAsOneProcess) {
  const Case c = GetParam();
  const Tensors expected = reference(c.usage, c.world);
  auto got = results_of_ranks<Tensors>(
      c.world, [&](std::shared_ptr<Communicator> comm) { return distributed(c, comm); });
  expect_ranks_match(got, expected);
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (int e = 0; e < kEngines; ++e) {
    for (Usage usage : {Usage::Nowhere, Usage::Rank0, Usage::Every}) {
      for (int world = 1; world <= 3; ++world) {
        cases.push_back(Case{static_cast<Engine>(e), world, usage});
      }
    }
  }
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  static const char* const usages[] = {"_unused", "_rank0_first", "_every_first"};
  return engine_name(info.param.engine) + usages[static_cast<int>(info.param.usage)] + "_world" +
         std::to_string(info.param.world);
}

INSTANTIATE_TEST_SUITE_P(EnginesAndWorlds, CheckpointUnusedParameterAccumulation,
                         ::testing::ValuesIn(all_cases()), case_name);

}  // namespace
}  // namespace cohort::testing::unused_parameter_accumulation_test
