// Which parameters DDP keeps alike across ranks and which gradients it
// leaves, against one process of plain LibTorch, on every engine ranks as
// threads run on, at worlds 1 to 3.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <optional>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::parameters_test {
namespace {

struct Case {
  std::string backend;
  int world;
};

std::vector<Case> cases() {
  std::vector<std::string> backends = {"gloo"};
#ifdef COHORT_WITH_UCX
  backends.push_back("ucx");
#endif
  std::vector<Case> out;
  for (const auto& b : backends) {
    for (int w : {1, 2, 3}) out.push_back({b, w});
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.backend + "_world" + std::to_string(info.param.world);
}

// gtest prints a failing case's parameter.
void PrintTo(const Case& c, std::ostream* os) { *os << c.backend << " world " << c.world; }

ThreadRanksOptions options_for(const Case& c) {
  ThreadRanksOptions o;
  o.backend = c.backend;
  return o;
}

// Values drawn from `seed` alone (ranks are threads: no global generator).
torch::Tensor draw(uint64_t seed, at::IntArrayRef sizes) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randn(sizes, gen);
}

void init_parameters(torch::nn::Module& m, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.copy_(draw(seed++, p.sizes()) * 0.5);
}

// Each parameter's .grad (undefined where it has none).
std::vector<torch::Tensor> grads_of(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) {
    out.push_back(p.grad().defined() ? p.grad().detach().clone() : torch::Tensor());
  }
  return out;
}

// Same definedness, and values within `tolerance`.
void expect_grads(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                  const std::vector<std::string>& names, const std::string& where,
                  double tolerance = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << where;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!want[i].defined()) {
      EXPECT_FALSE(got[i].defined()) << where << ": '" << names[i] << "' has a gradient, "
                                     << "one process has none";
      continue;
    }
    ASSERT_TRUE(got[i].defined()) << where << ": '" << names[i] << "' has no gradient";
    EXPECT_LT((got[i] - want[i]).abs().max().item<double>(), tolerance)
        << where << ": '" << names[i] << "'";
  }
}

class DdpParameters : public ::testing::TestWithParam<Case> {};

// ---- Parameters without requires_grad ----

// A frozen feature layer (drawn after a per-rank seed, as a program that
// seeds by rank draws it) under a trainable head; `extra` frozen elements
// in a vector of their own.
struct FrozenNetImpl : torch::nn::Module {
  torch::nn::Linear features{nullptr}, head{nullptr};
  torch::Tensor scale;
  explicit FrozenNetImpl(int64_t extra = 2) {
    features = register_module("features", torch::nn::Linear(4, 6));
    head = register_module("head", torch::nn::Linear(6, 2));
    scale = register_parameter("scale", torch::ones({extra}), /*requires_grad=*/false);
    for (auto& p : features->parameters()) p.set_requires_grad(false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(torch::tanh(features(x))) * scale.sum();
  }
};
TORCH_MODULE(FrozenNet);

// Every rank ends with rank 0's frozen values, so the gradients are one
// process's on the whole batch from rank 0's model; frozen tensors whose
// shapes differ across ranks are a MismatchError on every rank.
TEST_P(DdpParameters, FrozenParametersAreRankZeros) {
  const auto c = GetParam();
  torch::set_num_threads(1);
  constexpr int64_t kRows = 3;
  const auto x = draw(1, {c.world * kRows, 4}), y = draw(2, {c.world * kRows, 2});
  FrozenNet reference;
  init_parameters(*reference, 100);
  {
    torch::NoGradGuard no_grad;
    reference->scale.fill_(0.75);
  }
  const auto rank0 = clone_all(reference->parameters());
  torch::mse_loss(reference->forward(x), y).backward();
  const auto want = grads_of(reference->parameters());

  std::vector<std::string> names;
  for (const auto& p : reference->named_parameters()) names.push_back(p.key());
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        const int r = comm->rank();
        FrozenNet model;
        init_parameters(*model, 100 + 1000 * r);  // rank 0's is the reference's
        {
          torch::NoGradGuard no_grad;
          model->scale.fill_(0.75 + r);
        }
        DistributedDataParallel<FrozenNet> ddp(model, comm);
        const auto params = model->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_TRUE(torch::equal(params[i], rank0[i]))
              << "rank " << r << ": '" << names[i] << "' is not rank 0's";
        }
        torch::mse_loss(ddp.forward(x.narrow(0, r * kRows, kRows)), y.narrow(0, r * kRows, kRows))
            .backward();
        expect_grads(grads_of(params), want, names, "rank " + std::to_string(r));

        if (c.world == 1) return;
        // The last rank's frozen vector is longer; the trainable parameters match.
        FrozenNet other(r == c.world - 1 ? 3 : 2);
        try {
          DistributedDataParallel<FrozenNet> refused(other, comm);
          ADD_FAILURE() << "no error on rank " << r;
        } catch (const MismatchError& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("parameters without requires_grad"), std::string::npos) << m;
          EXPECT_NE(m.find("'scale'"), std::string::npos) << m;
          EXPECT_NE(m.find("[3] on rank " + std::to_string(c.world - 1)), std::string::npos) << m;
        }
      },
      options_for(c));
}

INSTANTIATE_TEST_SUITE_P(Ddp, DdpParameters, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::parameters_test
