// A weight tied across stages on different ranks (PipelineStage::tie): each
// rank holds its own copy, as separate processes do. The runtime makes the
// copies equal at construction and sums their gradients at the end of each
// step, so that AdamW steps every copy as one process steps the one weight;
// accumulating over two steps sums each step once; copies that cannot be
// one weight are refused on every rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline/pipeline_test_models.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline_tied_test {
namespace {

using namespace cohort::pipeline;
using namespace cohort::pipeline::testing;

struct Case {
  const char* schedule;
  int pp, v, m;
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.schedule) + "_pp" + std::to_string(c.pp) + "_v" + std::to_string(c.v) +
         "_m" + std::to_string(c.m);
}

constexpr int kSteps = 3;
constexpr int64_t kMicro = 2;

torch::optim::AdamW adamw(std::vector<torch::Tensor> params) {
  return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(0.05).weight_decay(0.1));
}

// Every stage's tensors after the run: W per stage that holds a copy, A and
// B per stage (the reference's stage s holds the one W).
using StageTensors = std::map<int, TiedParams>;

StageTensors snapshot(const std::map<int, TiedParams>& params) {
  StageTensors out;
  for (const auto& [s, p] : params) {
    auto keep = [](const torch::Tensor& t) { return t.defined() ? t.detach().clone() : t; };
    out[s] = {keep(p.w), keep(p.a), keep(p.b)};
  }
  return out;
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what;
  const double err = (got - want).abs().max().item<double>();
  EXPECT_LE(err, 1e-5 * want.abs().max().item<double>()) << what << ": off by " << err;
}

class TiedWeight : public ::testing::TestWithParam<Case> {};

// kSteps AdamW steps (weight decay too, which would step a copy by its own
// value): every stage's copy of W equals the one process's W.
TEST_P(TiedWeight, CopiesStepAsOneWeight) {
  const Case c = GetParam();
  const auto schedule = make_schedule(c.schedule, c.pp, c.v, c.m);
  const int stages = schedule.num_stages;
  const auto x = det({kSteps * c.m * kMicro, kWidth}, 0.3);
  const auto y = det({kSteps * c.m * kMicro, kWidth}, 1.1);
  auto ref = tied_reference(stages);
  auto ref_opt = adamw(ref.parameters());
  const int64_t batch = c.m * kMicro;
  for (int s = 0; s < kSteps; ++s) {
    ref_opt.zero_grad();
    torch::nn::functional::mse_loss(ref.forward(x.narrow(0, s * batch, batch)),
                                    y.narrow(0, s * batch, batch))
        .backward();
    ref_opt.step();
  }
  auto runs = cohort::testing::results_of_ranks<StageTensors>(
      c.pp, [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        std::vector<PipelineStage> mine;
        std::map<int, TiedParams> params;
        for (int s : schedule.stages_of(comm->rank())) {
          // Each copy starts elsewhere: the runtime broadcasts stage 0's.
          mine.push_back(tied_stage(s, stages, /*offset=*/0.25));
          const auto& p = mine.back().parameters();
          TiedParams t = tied_params(s, stages);
          size_t i = 0;
          for (auto* slot : {&t.w, &t.a, &t.b})
            if (slot->defined()) *slot = p[i++];
          params[s] = t;
        }
        PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
        auto opt = adamw(rt.parameters());
        for (int s = 0; s < kSteps; ++s) {
          opt.zero_grad();
          rt.step({x.narrow(0, s * batch, batch)}, {y.narrow(0, s * batch, batch)});
          opt.step();
        }
        return snapshot(params);
      });
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.pp));
  int copies = 0;
  for (const auto& [rank, run] : runs) {
    for (const auto& [s, p] : run) {
      const std::string where = "rank " + std::to_string(rank) + ", stage " + std::to_string(s);
      if (p.w.defined()) {
        ++copies;
        expect_close(p.w, ref.w, where + ", W");
      }
      if (p.a.defined()) expect_close(p.a, ref.stage[s].a, where + ", A");
      if (p.b.defined()) expect_close(p.b, ref.stage[s].b, where + ", b");
    }
  }
  EXPECT_EQ(copies, stages >= 3 ? 3 : stages);
}

// Two steps without zeroing add up two steps' gradients, each summed over
// the copies once (the first step's sum is not summed again).
TEST_P(TiedWeight, AccumulatesOverStepsOnce) {
  const Case c = GetParam();
  const auto schedule = make_schedule(c.schedule, c.pp, c.v, c.m);
  const int stages = schedule.num_stages;
  const int64_t batch = c.m * kMicro;
  const auto x = det({2 * batch, kWidth}, 0.7);
  const auto y = det({2 * batch, kWidth}, 1.9);
  auto ref = tied_reference(stages);
  for (int s = 0; s < 2; ++s)
    torch::nn::functional::mse_loss(ref.forward(x.narrow(0, s * batch, batch)),
                                    y.narrow(0, s * batch, batch))
        .backward();
  const torch::Tensor want = ref.w.grad().clone();
  auto grads = cohort::testing::results_of_ranks<std::vector<torch::Tensor>>(
      c.pp, [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        std::vector<PipelineStage> mine;
        for (int s : schedule.stages_of(comm->rank())) mine.push_back(tied_stage(s, stages));
        PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
        for (int s = 0; s < 2; ++s)
          rt.step({x.narrow(0, s * batch, batch)}, {y.narrow(0, s * batch, batch)});
        std::vector<torch::Tensor> out;
        for (const auto& tied : rt.tied_weights())
          for (const auto& t : tied.copies->copies()) out.push_back(t.grad().clone());
        return out;
      });
  for (const auto& [rank, list] : grads) {
    for (const auto& g : list) expect_close(g, want, "rank " + std::to_string(rank) + ", grad W");
  }
}

INSTANTIATE_TEST_SUITE_P(Pipeline, TiedWeight,
                         ::testing::Values(Case{"1f1b", 1, 1, 2}, Case{"1f1b", 2, 1, 2},
                                           Case{"gpipe", 3, 1, 3}, Case{"zbh1", 3, 1, 3},
                                           Case{"interleaved", 2, 2, 4}),
                         name_of);

// The original is the lowest stage's copy, not the lowest rank's:
// interleaved over two ranks, W tied between stage 1 (rank 1) and stage 2
// (rank 0), each copy built with its own values, starts as stage 1's.
TEST(TiedWeightOriginal, IsTheLowestStagesCopy) {
  const auto schedule = make_schedule("interleaved", 2, 2, 4);
  auto got =
      cohort::testing::results_of_ranks<torch::Tensor>(2, [&](std::shared_ptr<Communicator> comm) {
        std::vector<PipelineStage> mine;
        torch::Tensor copy;
        for (int s : schedule.stages_of(comm->rank())) {
          auto w = det({kWidth, kWidth}, 2.0 + s).requires_grad_(true);
          PipelineStage stage(
              s, [w](const Tensors& in) { return Tensors{torch::tanh(in[0].matmul(w))}; }, {w});
          if (s == 1 || s == 2) {
            stage.tie("w", w);
            copy = w;
          }
          mine.push_back(std::move(stage));
        }
        PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
        const auto& tied = rt.tied_weights();
        EXPECT_EQ(tied.size(), 1u);
        EXPECT_EQ(tied.front().stages, (std::vector<int>{1, 2}));
        EXPECT_EQ(tied.front().copies->holds_original(), comm->rank() == 1);
        return copy.detach().clone();
      });
  for (const auto& [rank, w] : got)
    EXPECT_TRUE(torch::equal(w, det({kWidth, kWidth}, 3.0))) << "rank " << rank;
}

// Stage `s` of a two-stage model whose last stage's copy of W has `cols`
// columns, or that ties it only when `tie_last`.
PipelineStage odd_stage(int s, int64_t cols, bool tie_last) {
  auto w = det({kWidth, s == 0 ? kWidth : cols}, 2.0).requires_grad_(true);
  PipelineStage stage(s, [w](const Tensors& in) { return Tensors{torch::tanh(in[0].matmul(w))}; },
                      {w});
  if (s == 0 || tie_last) stage.tie("w", w);
  return stage;
}

// Every rank throws, the one without a bad copy too, naming the weight.
void expect_refused_everywhere(int64_t cols, bool tie_last, const std::string& part) {
  auto errors = cohort::testing::results_of_ranks<std::string>(
      2, [&](std::shared_ptr<Communicator> comm) -> std::string {
        try {
          PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"),
                             {odd_stage(comm->rank(), cols, tie_last)}, Schedule1F1B(2, 2), mse);
        } catch (const InvalidArgument& e) {
          return e.what();
        }
        return "accepted";
      });
  for (const auto& [rank, what] : errors) {
    EXPECT_NE(what.find("tied weight 'w'"), std::string::npos) << "rank " << rank << ": " << what;
    EXPECT_NE(what.find(part), std::string::npos) << "rank " << rank << ": " << what;
  }
}

TEST(TiedWeightErrors, CopiesOfAnotherShapeAreRefusedOnEveryRank) {
  expect_refused_everywhere(kWidth + 1, true, "[6, 6] Float on rank 0, [6, 7] Float on rank 1");
}

TEST(TiedWeightErrors, AKeyOfOneStageIsRefusedOnEveryRank) {
  expect_refused_everywhere(kWidth, false, "declared by stage 0 only");
}

TEST(TiedWeightErrors, TyingATensorOfAnotherStageIsRefused) {
  auto w = det({kWidth, kWidth}, 2.0).requires_grad_(true);
  PipelineStage stage(0, [w](const Tensors& in) { return Tensors{in[0].matmul(w)}; }, {w});
  EXPECT_THROW(stage.tie("w", w.detach().clone().requires_grad_(true)), InvalidArgument);
  EXPECT_THROW(stage.tie("", w), InvalidArgument);
}

}  // namespace
}  // namespace cohort::pipeline_tied_test
