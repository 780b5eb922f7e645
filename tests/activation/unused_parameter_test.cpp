// A checkpointed block whose forward leaves a parameter out in some steps
// (a branch): the recompute returns no gradient for it, yet the engine still
// runs its accumulator. Every data-parallel path (DDP, the fused optimizer,
// ZeRO-1 and ZeRO-2 alone and ZeRO-2 under DDP, AllReduceGradientSync,
// fully_shard with the checkpoint around a unit or inside the root, HSDP) must
// leave its .grad undefined where no rank used it, as one process does, so
// AdamW skips it instead of stepping a zero gradient (weight decay and
// momentum would move it); where some ranks used it, its gradient is the
// average with zeros for the others (DDP's find_unused_parameters). DDP
// without find_unused_parameters reports it missing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "cohort/activation/checkpoint.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/plan/gradient_sync.h"
#include "support/thread_ranks.h"
#include "tests/activation/gate_model.h"

namespace cohort::testing::unused_parameter_test {
namespace {

using namespace gate;

constexpr int kSteps = 3;
// b is used in step 0 on every rank; after it on no rank, or on rank 0 only.
enum class Usage { Nowhere, Rank0 };
bool uses_b(Usage usage, int step, int rank) {
  return step == 0 || (usage == Usage::Rank0 && rank == 0);
}

// One process, no checkpointing: the mean of the ranks' losses, each rank's
// rows through the branch that rank takes, so a parameter some ranks leave
// out gets the average with zeros for them.
Tensors reference(Usage usage, int world) {
  bool use_b = true;
  auto model = make_model(&use_b, false);
  torch::optim::AdamW opt(model->parameters(), kAdamW);
  for (int s = 0; s < kSteps; ++s) {
    model->zero_grad(/*set_to_none=*/true);
    torch::Tensor loss = torch::zeros({});
    for (int r = 0; r < world; ++r) {
      use_b = uses_b(usage, s, r);
      loss = loss +
             torch::mse_loss(model->forward(rows(inputs(s, world), r)), rows(targets(s, world), r));
    }
    (loss / world).backward();
    opt.step();
  }
  return values(model->parameters());
}

struct Case {
  Engine engine;
  int world;
  Usage usage;
};

// `step` after each backward, over the checkpointed model `forward` runs.
template <class Forward, class ZeroGrad, class Step>
void train(const Case& c, int rank, bool* use_b, Forward&& forward, ZeroGrad&& zero_grad,
           Step&& step) {
  for (int s = 0; s < kSteps; ++s) {
    *use_b = uses_b(c.usage, s, rank);
    zero_grad();
    auto x = rows(inputs(s, c.world), rank), y = rows(targets(s, c.world), rank);
    torch::mse_loss(forward(x), y).backward();
    step();
  }
}

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
      [&] { model->zero_grad(/*set_to_none=*/true); }, [&] { opt.step(); });
  Tensors out;
  for (const auto& p : model->full_state_dict()) out.push_back(p.value().clone());
  return out;
}

Tensors zero(const Case& c, const std::shared_ptr<Communicator>& comm) {
  bool use_b = true;
  auto model = make_model(&use_b, true);
  ZeroOptions zo;
  zo.stage = c.engine == Engine::Zero1 ? 1 : 2;
  auto run = [&](auto&& forward, ZeroRedundancyOptimizer& opt) {
    train(
        c, comm->rank(), &use_b, forward, [&] { opt.zero_grad(/*set_to_none=*/true); },
        [&] { opt.step(); });
  };
  if (c.engine == Engine::DdpZero2) {
    // ZeRO-2 takes over DDP's reduction: DDP reports each gradient to it.
    DDPOptions options;
    options.find_unused_parameters = true;
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
    auto opt = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, kAdamW, zo);
    run([&](const torch::Tensor& x) { return ddp.forward(x); }, *opt);
  } else {
    auto opt =
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(model->parameters(), comm, kAdamW, zo);
    run([&](const torch::Tensor& x) { return model->forward(x); }, *opt);
  }
  return values(model->parameters());
}

Tensors distributed(const Case& c, const std::shared_ptr<Communicator>& comm) {
  torch::set_num_threads(1);
  if (sharded_engine(c.engine)) return sharded(c, comm);
  if (c.engine == Engine::Zero1 || c.engine == Engine::Zero2 || c.engine == Engine::DdpZero2)
    return zero(c, comm);
  const int r = comm->rank();
  bool use_b = true;
  auto model = make_model(&use_b, true);
  auto forward = [&](const torch::Tensor& x) { return model->forward(x); };
  auto zero_grad = [&] { model->zero_grad(/*set_to_none=*/true); };
  if (c.engine == Engine::Ddp) {
    DDPOptions options;
    options.find_unused_parameters = true;
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
    torch::optim::AdamW opt(ddp.parameters(), kAdamW);
    train(
        c, r, &use_b, [&](const torch::Tensor& x) { return ddp.forward(x); },
        [&] { ddp.zero_grad(/*set_to_none=*/true); }, [&] { opt.step(); });
  } else if (c.engine == Engine::Fused) {
    FusedDistributedOptimizer opt(model->parameters(), comm, kAdamW);
    train(
        c, r, &use_b, forward, [&] { opt.zero_grad(/*set_to_none=*/true); }, [&] { opt.step(); });
  } else {
    // The Trainer's sync for a model without DDP: averaged after backward.
    AllReduceGradientSync sync(comm, model->parameters());
    torch::optim::AdamW opt(model->parameters(), kAdamW);
    train(c, r, &use_b, forward, zero_grad, [&] {
      sync.finish_sync();
      opt.step();
    });
  }
  return values(model->parameters());
}

class CheckpointUnusedParameter : public ::testing::TestWithParam<Case> {};

TEST_P(CheckpointUnusedParameter, StepsAsOneProcess) {
  const Case c = GetParam();
  const Tensors expected = reference(c.usage, c.world);
  auto got = results_of_ranks<Tensors>(
      c.world, [&](std::shared_ptr<Communicator> comm) { return distributed(c, comm); });
  expect_ranks_match(got, expected);
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (int e = 0; e < kEngines; ++e) {
    for (Usage usage : {Usage::Nowhere, Usage::Rank0}) {
      for (int world = 1; world <= 3; ++world) {
        cases.push_back(Case{static_cast<Engine>(e), world, usage});
      }
    }
  }
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return engine_name(info.param.engine) +
         (info.param.usage == Usage::Nowhere ? "_unused_world" : "_rank0_world") +
         std::to_string(info.param.world);
}

INSTANTIATE_TEST_SUITE_P(EnginesAndWorlds, CheckpointUnusedParameter,
                         ::testing::ValuesIn(all_cases()), case_name);

// A pipeline of two stages (the checkpointed gate, then the Linear), two
// micro-batches of 3 rows, b used in step 0 only: the runtime's gradients of
// a step are those of the whole batch's mean loss, the reference at world 2
// with each micro-batch as a rank's rows. Its weight gradients come from
// autograd::grad, which gives the left-out parameter none.
struct PipeCase {
  std::string schedule;
  bool function_stage;  // a ForwardFn stage, or a Sequential of checkpointed blocks
};

class CheckpointUnusedParameterPipeline : public ::testing::TestWithParam<PipeCase> {};

TEST_P(CheckpointUnusedParameterPipeline, StepsAsOneProcess) {
  const PipeCase k = GetParam();
  const Tensors expected = reference(Usage::Nowhere, 2);
  auto got = results_of_ranks<Tensors>(2, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const int r = comm->rank();
    bool use_b = true;
    auto seq = pipeline::split_sequential(make_model(&use_b, false), {1}, r);
    auto stage = k.function_stage
                     ? pipeline::PipelineStage(
                           r,
                           [seq, r](const Tensors& in) {
                             auto fn = [seq](const Tensors& t) mutable {
                               return Tensors{seq->forward(t[0])};
                             };
                             return r == 0 ? checkpoint(fn, in, seq->parameters()) : fn(in);
                           },
                           seq->parameters(), seq.ptr())
                     : pipeline::PipelineStage(r, r == 0 ? checkpoint_blocks(seq) : seq);
    auto mse = [](const Tensors& out, const Tensors& t) { return torch::mse_loss(out[0], t[0]); };
    pipeline::PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"), {stage},
                                 pipeline::make_schedule(k.schedule, 2, 1, 2), mse);
    torch::optim::AdamW opt(seq->parameters(), kAdamW);
    for (int s = 0; s < kSteps; ++s) {
      use_b = uses_b(Usage::Nowhere, s, 0);
      seq->zero_grad(/*set_to_none=*/true);
      rt.step({inputs(s, 2)}, {targets(s, 2)});
      opt.step();
    }
    return values(seq->parameters());
  });
  for (const auto& [rank, params] : got) {
    const size_t first = rank == 0 ? 0 : 4;  // the gate's a and b, then the Linear
    ASSERT_EQ(params.size(), rank == 0 ? 4u : 2u);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LT((params[i] - expected[first + i]).abs().max().item<double>(), 1e-6)
          << "parameter " << first + i << ", rank " << rank;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, CheckpointUnusedParameterPipeline,
                         ::testing::Values(PipeCase{"1f1b", false}, PipeCase{"zbh1", false},
                                           PipeCase{"1f1b", true}, PipeCase{"zbh1", true}),
                         [](const auto& info) {
                           return info.param.schedule +
                                  (info.param.function_stage ? "_function" : "_sequential");
                         });

// Without find_unused_parameters, a parameter the checkpointed block left out
// is missing as one outside the graph: the next forward fails on every rank.
class CheckpointMissingGradient : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointMissingGradient, NextForwardFailsOnEveryRank) {
  const int world = GetParam();
  auto failed = results_of_ranks<std::string>(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const int r = comm->rank();
    bool use_b = true;
    auto model = make_model(&use_b, true);
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, DDPOptions{});
    for (int s = 0; s < 2; ++s) {
      use_b = s == 0;
      ddp.zero_grad(/*set_to_none=*/true);
      auto x = rows(inputs(s, world), r), y = rows(targets(s, world), r);
      torch::mse_loss(ddp.forward(x), y).backward();
    }
    try {
      ddp.forward(rows(inputs(2, world), r));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  });
  ASSERT_FALSE(failed.empty());
  for (const auto& [rank, message] : failed) {
    EXPECT_NE(message.find("did not produce gradients"), std::string::npos)
        << "rank " << rank << ": " << message;
    EXPECT_NE(message.find("b.weight"), std::string::npos) << "rank " << rank << ": " << message;
    EXPECT_NE(message.find("on rank " + std::to_string(rank)), std::string::npos) << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, CheckpointMissingGradient, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::unused_parameter_test
