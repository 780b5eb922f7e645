// zero_grad's two meanings in ZeRO (stages 1 and 2, alone and over cohort
// DDP) and the fused optimizer, against one process of plain LibTorch AdamW
// cleared the same way, at worlds 1 and 3: a layer used at odd steps only
// (by one rank) steps with a zero gradient at the steps between when its
// .grad is zeroed in place (LibTorch 1.13's Optimizer::zero_grad(),
// zero_grad(false)), and is skipped then when it is set to none (2.x's,
// zero_grad(true)). Weight decay moves a parameter stepped with zeros.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"

namespace cohort::testing::zero_grad_test {
namespace {

using Case = EngineWorld;

const auto kAdamW = torch::optim::AdamWOptions(0.01).weight_decay(0.1);
// The last step is an even one: the layer gets no gradient there.
constexpr int kSteps = 5;
constexpr double kTolerance = 1e-5;
constexpr double kTinyBucketMb = 16.0 * 4 / (1024 * 1024);  // 16 floats

// `odd` takes part only when the forward is told to.
struct SometimesNetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, odd{nullptr}, b{nullptr};
  SometimesNetImpl() {
    a = register_module("a", torch::nn::Linear(5, 7));
    odd = register_module("odd", torch::nn::Linear(7, 7));
    b = register_module("b", torch::nn::Linear(7, 3));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.5);
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_odd) {
    auto h = torch::tanh(a(x));
    if (use_odd) h = h + torch::tanh(odd(h));
    return b(h);
  }
};
TORCH_MODULE(SometimesNet);

// Rank r uses `odd` at odd steps, one rank at a time.
bool uses_odd(int step, int rank, int world) { return step % 2 == 1 && rank == (step / 2) % world; }

torch::Tensor batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + 10 * step + rank);
  return torch::randn({4, 5}, gen);
}

// How the optimizer's gradients are cleared before each step.
enum class Clear { Default, ToNone, InPlace };
const char* name(Clear c) {
  return c == Clear::Default ? "zero_grad()"
                             : (c == Clear::ToNone ? "zero_grad(true)" : "zero_grad(false)");
}

// One process: the mean of the ranks' losses, cleared as `clear` says
// (Default: LibTorch's own Optimizer::zero_grad()).
std::vector<torch::Tensor> reference(int world, Clear clear) {
  SometimesNet net;
  torch::optim::AdamW opt(net->parameters(), kAdamW);
  for (int s = 0; s < kSteps; ++s) {
    if (clear == Clear::Default) {
      opt.zero_grad();
    } else {
      net->zero_grad(/*set_to_none=*/clear == Clear::ToNone);
    }
    torch::Tensor loss;
    for (int r = 0; r < world; ++r) {
      auto l = net->forward(batch(s, r), uses_odd(s, r, world)).pow(2).mean() / world;
      loss = loss.defined() ? loss + l : l;
    }
    loss.backward();
    opt.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

struct Way {
  std::string name;
  bool fused = false;
  int stage = 1;
  bool ddp = false;  // over cohort DDP (find_unused_parameters), else alone
  double bucket_cap_mb = 25;
};

const std::vector<Way> kWays = {
    {"ZeRO-1", false, 1},
    {"ZeRO-2", false, 2},
    {"ZeRO-2, 16-float buckets", false, 2, false, kTinyBucketMb},
    {"ZeRO-1 over DDP", false, 1, true},
    {"ZeRO-2 over DDP", false, 2, true},
    {"fused", true},
};

template <typename Opt>
void clear_grads(Opt& opt, Clear clear) {
  if (clear == Clear::Default) {
    opt.zero_grad();
  } else {
    opt.zero_grad(clear == Clear::ToNone);
  }
}

// Rank r's parameters after kSteps steps the way `way` says.
std::vector<torch::Tensor> train(const std::shared_ptr<Communicator>& comm, const Way& way,
                                 Clear clear) {
  const int r = comm->rank(), world = comm->size();
  SometimesNet net;
  std::unique_ptr<DistributedDataParallel<SometimesNet>> ddp;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<FusedDistributedOptimizer> fused;
  if (way.fused) {
    fused = std::make_unique<FusedDistributedOptimizer>(net->parameters(), comm, kAdamW);
  } else {
    ZeroOptions zo;
    zo.stage = way.stage;
    zo.bucket_cap_mb = way.bucket_cap_mb;
    if (way.ddp) {
      DDPOptions o;
      o.find_unused_parameters = true;
      ddp = std::make_unique<DistributedDataParallel<SometimesNet>>(net, comm, o);
      zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(*ddp, kAdamW, zo);
    } else {
      zero =
          ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kAdamW, zo);
    }
  }
  for (int s = 0; s < kSteps; ++s) {
    if (zero) clear_grads(*zero, clear);
    if (fused) clear_grads(*fused, clear);
    const bool use = uses_odd(s, r, world);
    (ddp ? ddp->forward(batch(s, r), use) : net->forward(batch(s, r), use))
        .pow(2)
        .mean()
        .backward();
    if (zero) zero->step();
    if (fused) fused->step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

class ZeroGrad : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroGrad, StepsWhatLibTorchAdamWStepsAfterTheSameZeroGrad) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  std::vector<std::string> names;
  for (const auto& p : SometimesNet()->named_parameters()) names.push_back(p.key());
  // The two meanings part (by weight decay and moments on `odd`), so the
  // comparison below tells them apart.
  const auto to_none = reference(c.world, Clear::ToNone);
  const auto in_place = reference(c.world, Clear::InPlace);
  ASSERT_GT((to_none[2] - in_place[2]).abs().max().item<double>(), 1e-3);

  for (const auto& way : kWays) {
    for (const Clear clear : {Clear::Default, Clear::ToNone, Clear::InPlace}) {
      const auto want = clear == Clear::Default ? reference(c.world, clear)
                                                : (clear == Clear::ToNone ? to_none : in_place);
      run_ranks_shared(
          c.world,
          [&](std::shared_ptr<Communicator> comm) {
            const auto got = train(comm, way, clear);
            for (size_t i = 0; i < got.size(); ++i) {
              EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), kTolerance)
                  << way.name << ", " << name(clear) << ", rank " << comm->rank() << ": '"
                  << names[i] << "'";
            }
          },
          options_for(c));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, ZeroGrad, ::testing::ValuesIn(engine_worlds({1, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::zero_grad_test
