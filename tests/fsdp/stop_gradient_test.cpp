// fully_shard with a unit whose forward also reads its own trainable weight
// with no autograd edge to it (a stop-gradient read), ranks as threads at
// world 1 to 3 (and 4 for reshard_after_forward = 2), resharding after
// forward or not. Such a read saves an alias of the full parameter for its
// backward, which may run after the weight's gradient has landed: the unit
// must stay gathered until then. The unit reads its weight w [n, n]:
//
//   detached      tanh(x @ w.detach()^T) @ w;
//   no-grad view  w2 = w^T made under NoGradGuard, tanh(x @ w2) @ w;
//
// each behind a root Linear(5, 7) (the unit's input needs a gradient), and
// the detached read as the first layer, on x @ a with a trainable a [5, 7]
// of the unit (its input is the data, which needs no gradient: the read's
// backward leads to a's gradient only, and the unit is over with its
// gradients). After 3 SGD steps every parameter equals the one-process
// model's within 1e-6 relative.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::stop_gradient_test {
namespace {

using namespace cohort::testing::fsdp_test;
using cohort::testing::EngineWorld;

constexpr int kStepsHere = 3;

enum class Read { kDetached, kNoGradView, kDetachedFirst };

std::string name_of(Read r) {
  switch (r) {
    case Read::kDetached:
      return "detached";
    case Read::kNoGradView:
      return "no-grad view";
    case Read::kDetachedFirst:
      return "detached, first layer";
  }
  return "";
}

// tanh(x @ r(w)) @ w, with r(w) a stop-gradient read of w [7, 7] (see the
// file comment); with `in` other than 7, x @ a first.
struct StopGradientReadImpl : torch::nn::Module {
  StopGradientReadImpl(int64_t in, bool view) : view(view) {
    if (in != 7) a = register_parameter("a", torch::zeros({in, 7}));
    w = register_parameter("w", torch::zeros({7, 7}));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (a.defined()) x = x.matmul(a);
    torch::Tensor read;
    if (view) {
      torch::NoGradGuard no_grad;
      read = w.t();
    } else {
      read = w.detach().t();
    }
    return torch::tanh(x.matmul(read)).matmul(w);
  }
  torch::Tensor a, w;
  bool view;
};
TORCH_MODULE(StopGradientRead);

// The model of `read`; with `comm` the reading block is a unit over it.
Sequential build(Read read, const std::shared_ptr<Communicator>& comm,
                 const FullyShardOptions& options) {
  const bool first = read == Read::kDetachedFirst;
  AnyModule block(StopGradientRead(first ? 5 : 7, read == Read::kNoGradView));
  if (comm) block = AnyModule(FullyShard(block, comm, options));
  Sequential seq;
  if (!first) {
    seq->push_back(Linear(5, 7));
    seq->push_back(Tanh());
  }
  seq->push_back(block);
  seq->push_back(Tanh());
  seq->push_back(Linear(7, 3));
  return seq;
}

Batches batches() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  Batches b;
  for (int s = 0; s < kStepsHere; ++s) {
    b.x.push_back(torch::randn({kBatch, 5}, gen));
    b.y.push_back(torch::randn({kBatch, 3}, gen));
  }
  return b;
}

Named reference(Read read, const Batches& b) {
  auto model = build(read, nullptr, {});
  init_parameters(*model, 3);
  auto opt = make_optimizer(Opt::SGD, model->parameters());
  for (int s = 0; s < kStepsHere; ++s) {
    opt->zero_grad();
    torch::mse_loss(model->forward(b.x[s]), b.y[s]).backward();
    opt->step();
  }
  return parameters_of(*model);
}

std::map<int, Named> sharded(Read read, const EngineWorld& c, ReshardAfterForward reshard,
                             const Batches& b) {
  std::mutex mu;
  std::map<int, Named> got;
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        FullyShardOptions options;
        options.reshard_after_forward = reshard;
        auto model = fully_shard(build(read, comm, options), comm, options);
        auto twin = build(read, nullptr, {});
        init_parameters(*twin, 3);
        load_from(model, *twin);
        auto opt = make_optimizer(Opt::SGD, model->parameters());
        for (int s = 0; s < kStepsHere; ++s) {
          opt->zero_grad();
          auto out = model->forward(local(b.x[s], *comm));
          torch::mse_loss(out, local(b.y[s], *comm)).backward();
          opt->step();
        }
        auto state = model->full_state_dict();
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = std::move(state);
      },
      cohort::testing::options_for(c));
  return got;
}

struct Case {
  EngineWorld at;
  ReshardAfterForward reshard;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.at.backend << " world " << c.at.world << " reshard " << c.reshard.to_string();
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& at : cohort::testing::engine_worlds()) {
    out.push_back({at, true});
    out.push_back({at, false});
  }
  for (const auto& at : cohort::testing::engine_worlds({4})) out.push_back({at, 2});
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.at.backend + "_world" + std::to_string(info.param.at.world) + "_reshard_" +
         info.param.reshard.to_string();
}

class FSDPStopGradientRead : public ::testing::TestWithParam<Case> {};

TEST_P(FSDPStopGradientRead, TrainsAsOneProcess) {
  const auto b = batches();
  for (auto read : {Read::kDetached, Read::kNoGradView, Read::kDetachedFirst}) {
    SCOPED_TRACE(name_of(read));
    const auto want = reference(read, b);
    std::map<int, Named> got;
    try {
      got = sharded(read, GetParam().at, GetParam().reshard, b);
    } catch (const std::exception& e) {
      // The other reads still run.
      const std::string what = e.what();
      ADD_FAILURE() << "training threw: " << what.substr(0, what.find('\n'));
    }
    for (const auto& [rank, state] : got) {
      expect_close(state, want, 1e-6, "rank " + std::to_string(rank));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPStopGradientRead, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::stop_gradient_test
