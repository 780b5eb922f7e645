// A weight tied across stages on different ranks (PipelineStage::tie): each
// rank holds its own copy, as separate processes do. The runtime makes the
// copies equal at construction and sums their gradients at the end of each
// step, so that AdamW steps every copy as one process steps the one weight;
// accumulating over two steps sums each step once; copies that cannot be
// one weight are refused on every rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
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
// columns and dtype `last_dtype`, or that ties it only when `tie_last`.
PipelineStage odd_stage(int s, int64_t cols, bool tie_last,
                        torch::Dtype last_dtype = torch::kFloat32) {
  auto w = det({kWidth, s == 0 ? kWidth : cols}, 2.0)
               .to(s == 0 ? torch::kFloat32 : last_dtype)
               .requires_grad_(true);
  PipelineStage stage(s, [w](const Tensors& in) { return Tensors{torch::tanh(in[0].matmul(w))}; },
                      {w});
  if (s == 0 || tie_last) stage.tie("w", w);
  return stage;
}

// Every rank throws, the one without a bad copy too, naming the weight.
void expect_refused_everywhere(int64_t cols, bool tie_last, const std::string& part,
                               torch::Dtype last_dtype = torch::kFloat32) {
  auto errors = cohort::testing::results_of_ranks<std::string>(
      2, [&](std::shared_ptr<Communicator> comm) -> std::string {
        try {
          PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"),
                             {odd_stage(comm->rank(), cols, tie_last, last_dtype)},
                             Schedule1F1B(2, 2), mse);
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

TEST(TiedWeightErrors, CopiesOfAnotherDtypeAreRefusedOnEveryRank) {
  expect_refused_everywhere(kWidth, true, "[6, 6] Float on rank 0, [6, 6] Double on rank 1",
                            torch::kFloat64);
}

TEST(TiedWeightErrors, AKeyOfOneStageIsRefusedOnEveryRank) {
  expect_refused_everywhere(kWidth, false, "declared by stage 0 only");
}

// A chain of `stages` stages h = tanh(h W) over one W; `declare(s, stage,
// tensors)` makes stage s's declarations. Each rank builds its stages' own
// tensors; stages of one rank share one tensor when `share_local`. Returns
// per rank the error of the stage's construction or of the runtime's, or,
// when every declaration was accepted, how many times the one-process
// gradient of W one step left in each copy (1 is right).
using Declare = std::function<void(int, PipelineStage&, const std::vector<torch::Tensor>&)>;

std::map<int, std::string> chain_outcome(const PipelineSchedule& schedule, int tensors_per_stage,
                                         bool share_local, const Declare& declare) {
  const int stages = schedule.num_stages;
  const auto x = det({schedule.num_microbatches * kMicro, kWidth}, 0.3);
  const auto y = det({schedule.num_microbatches * kMicro, kWidth}, 1.1);
  auto w = det({kWidth, kWidth}, 2.0).requires_grad_(true);
  auto h = x;
  for (int s = 0; s < stages; ++s) h = torch::tanh(h.matmul(w));
  torch::nn::functional::mse_loss(h, y).backward();
  const torch::Tensor want = w.grad();
  cohort::testing::ThreadRanksOptions fast;
  fast.timeout = std::chrono::seconds(3);  // a rank left waiting fails soon
  return cohort::testing::results_of_ranks<std::string>(
      schedule.num_ranks,
      [&](std::shared_ptr<Communicator> comm) -> std::string {
        torch::set_num_threads(1);
        try {
          std::vector<PipelineStage> mine;
          std::vector<torch::Tensor> shared;
          for (int s : schedule.stages_of(comm->rank())) {
            std::vector<torch::Tensor> ts = shared;
            if (ts.empty() || !share_local) {
              ts.clear();
              for (int i = 0; i < tensors_per_stage; ++i)
                ts.push_back(det({kWidth, kWidth}, 2.0).requires_grad_(true));
              shared = ts;
            }
            // The stage's first tensor carries the model; others are idle.
            auto first = ts[0];
            PipelineStage stage(
                s, [first](const Tensors& in) { return Tensors{torch::tanh(in[0].matmul(first))}; },
                ts);
            declare(s, stage, ts);
            mine.push_back(std::move(stage));
          }
          PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
          rt.step({x}, {y});
          std::string out = "accepted, W's gradient x";
          for (const auto& tied : rt.tied_weights())
            for (const auto& t : tied.copies->copies())
              out += " " +
                     std::to_string(((t.grad() * want).sum() / (want * want).sum()).item<double>());
          return out;
        } catch (const InvalidArgument& e) {
          return e.what();
        } catch (const Error& e) {
          return std::string("not an InvalidArgument: ") + e.what();
        }
      },
      fast);
}

void expect_every_rank_says(const std::map<int, std::string>& outcome, size_t ranks,
                            const std::string& part) {
  ASSERT_EQ(outcome.size(), ranks);
  for (const auto& [rank, what] : outcome)
    EXPECT_NE(what.find(part), std::string::npos) << "rank " << rank << ": " << what;
}

// Each stage ties its W as "a" and as "b": summed over each key's holders,
// the gradient would be summed twice.
TEST(TiedWeightErrors, OneTensorUnderTwoKeysIsRefusedOnEveryRank) {
  const auto outcome =
      chain_outcome(make_schedule("1f1b", 2, 1, 2), 1, false,
                    [](int, PipelineStage& stage, const std::vector<torch::Tensor>& ts) {
                      stage.tie("a", ts[0]).tie("b", ts[0]);
                    });
  expect_every_rank_says(outcome, 2, "ties as 'b' the tensor that stage ");
}

// Two stages of one rank share W (allowed) but declare it under two keys.
TEST(TiedWeightErrors, OneTensorUnderTwoKeysOfTwoLocalStagesIsRefusedOnEveryRank) {
  const auto outcome =
      chain_outcome(make_schedule("interleaved", 2, 2, 4), 1, true,
                    [](int s, PipelineStage& stage, const std::vector<torch::Tensor>& ts) {
                      stage.tie(s < 2 ? "a" : "b", ts[0]);
                    });
  expect_every_rank_says(outcome, 2, "ties as 'b' the tensor that stage ");
}

// Stage 0 declares two of its tensors as one key: refused on every rank,
// not on stage 0's rank alone while the other waits.
TEST(TiedWeightErrors, TwoTensorsOfOneStageUnderOneKeyAreRefusedOnEveryRank) {
  const auto outcome =
      chain_outcome(make_schedule("1f1b", 2, 1, 2), 2, false,
                    [](int s, PipelineStage& stage, const std::vector<torch::Tensor>& ts) {
                      stage.tie("w", ts[0]);
                      if (s == 0) stage.tie("w", ts[1]);
                    });
  expect_every_rank_says(outcome, 2, "rank 0: stage 0 ties two of its tensors as 'w'");
}

// Declaring the same pair twice is one declaration: one sum, the right gradient.
TEST(TiedWeightErrors, TheSamePairDeclaredTwiceCountsOnce) {
  const auto outcome =
      chain_outcome(make_schedule("1f1b", 2, 1, 2), 1, false,
                    [](int, PipelineStage& stage, const std::vector<torch::Tensor>& ts) {
                      stage.tie("w", ts[0]).tie("w", ts[0]);
                    });
  ASSERT_EQ(outcome.size(), 2u);
  for (const auto& [rank, what] : outcome) {
    ASSERT_EQ(what.rfind("accepted, W's gradient x ", 0), 0u) << "rank " << rank << ": " << what;
    EXPECT_NEAR(std::stod(what.substr(25)), 1.0, 1e-5) << "rank " << rank;
  }
}

// A bad tie() call on the last stage: the stage keeps it aside and the
// runtime's construction refuses it on every rank, naming the rank, the
// stage and the key, where a throw from tie() would stop the last stage's
// rank alone while the others wait for the construction until their timeout.
enum class BadTie { kEmptyKey, kForeignTensor, kUndefinedTensor };

struct BadTieCase {
  Case schedule;
  BadTie bad;
};

std::string bad_tie_name(const ::testing::TestParamInfo<BadTieCase>& info) {
  static const char* kNames[] = {"empty_key", "foreign_tensor", "undefined_tensor"};
  return name_of(::testing::TestParamInfo<Case>(info.param.schedule, info.index)) + "_" +
         kNames[static_cast<int>(info.param.bad)];
}

class TiedWeightBadTie : public ::testing::TestWithParam<BadTieCase> {};

TEST_P(TiedWeightBadTie, IsRefusedOnEveryRank) {
  const Case c = GetParam().schedule;
  const BadTie bad = GetParam().bad;
  const auto schedule = make_schedule(c.schedule, c.pp, c.v, c.m);
  const int last = schedule.num_stages - 1;
  int last_rank = -1;
  for (int r = 0; r < schedule.num_ranks; ++r)
    for (int s : schedule.stages_of(r))
      if (s == last) last_rank = r;
  const auto outcome = chain_outcome(
      schedule, 1, false, [&](int s, PipelineStage& stage, const std::vector<torch::Tensor>& ts) {
        stage.tie("w", ts[0]);
        if (s != last) return;
        if (bad == BadTie::kEmptyKey) stage.tie("", ts[0]);
        if (bad == BadTie::kForeignTensor)
          stage.tie("w", det({kWidth, kWidth}, 2.0).requires_grad_(true));
        if (bad == BadTie::kUndefinedTensor) stage.tie("w", torch::Tensor());
        // The refused call declares nothing: the stage keeps the good one.
        EXPECT_EQ(stage.tied().size(), 1u);
      });
  const std::string why = bad == BadTie::kEmptyKey
                              ? "ties a tensor under an empty key"
                              : "ties as 'w' a tensor that is not one of the stage's parameters";
  expect_every_rank_says(outcome, static_cast<size_t>(schedule.num_ranks),
                         "rank " + std::to_string(last_rank) + ": stage " + std::to_string(last) +
                             " " + why + " (PipelineStage::tie)");
}

std::vector<BadTieCase> bad_tie_cases() {
  std::vector<BadTieCase> out;
  for (const Case& c : {Case{"1f1b", 1, 1, 2}, Case{"1f1b", 2, 1, 2}, Case{"gpipe", 3, 1, 3},
                        Case{"zbh1", 3, 1, 3}, Case{"interleaved", 2, 2, 4}})
    for (BadTie bad : {BadTie::kEmptyKey, BadTie::kForeignTensor, BadTie::kUndefinedTensor})
      out.push_back({c, bad});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Pipeline, TiedWeightBadTie, ::testing::ValuesIn(bad_tie_cases()),
                         bad_tie_name);

}  // namespace
}  // namespace cohort::pipeline_tied_test
