// The pipeline runtime against one process: every schedule x pp x v x m on a
// small MLP (ranks as threads), a boundary of several tensors, the errors.
// With COHORT_TEST_DEVICE=cuda PipelineEquivalence puts the models, the
// data and the reference on the GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <map>

#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/pipeline/schedule_validator.h"
#include "pipeline_test_models.h"
#include "support/tensor_checks.h"
#include "support/test_device.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline::runtime_test {
namespace {

using namespace cohort::pipeline::testing;
using cohort::testing::run_ranks_shared;

// |a - b| <= 1e-5 * max|b| (fp32, relative to the tensor's scale).
using cohort::testing::expect_close;

struct Case {
  std::string schedule;
  int pp, v, m;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.schedule + "_pp" + std::to_string(c.pp) + "_v" + std::to_string(c.v) + "_m" +
         std::to_string(c.m);
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (int pp : {2, 3, 4}) {
    for (const char* s : {"gpipe", "1f1b", "zbh1"})
      for (int m : {pp, 2 * pp, 2 * pp + 1}) out.push_back({s, pp, 1, m});
    for (int v : {1, 2})
      for (int m : {pp, 2 * pp}) out.push_back({"interleaved", pp, v, m});
  }
  return out;
}

class PipelineEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineEquivalence, LossesAndGradientsMatchOneProcess) {
  const Case c = GetParam();
  const int stages = c.pp * c.v;
  const auto device = cohort::testing::test_device();
  const auto x = det({2 * c.m, kWidth}, 0.3).to(device), y = det({2 * c.m, kWidth}, 1.1).to(device);
  const Reference ref = reference_run(stages, x, y, c.m);
  run_ranks_shared(c.pp, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto schedule = make_schedule(c.schedule, c.pp, c.v, c.m);
    auto model = make_mlp(stages, device);
    std::vector<PipelineStage> mine;
    for (int s : schedule.stages_of(comm->rank()))
      mine.emplace_back(s, split_sequential(model, mlp_boundaries(stages), s));
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
    auto result = rt.step({x}, {y});
    ASSERT_EQ(result.losses.size(), static_cast<size_t>(c.m));
    // Every action the rank ran is counted and timed, communication included.
    std::map<ActionType, int> ran;
    for (const Action& a : rt.schedule().actions[comm->rank()]) ++ran[a.type];
    EXPECT_EQ(result.action_count, ran);
    for (const auto& entry : ran) EXPECT_EQ(result.action_ms.count(entry.first), 1u);
    for (int i = 0; i < c.m; ++i)
      EXPECT_NEAR(result.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i]) + 1e-7)
          << "micro-batch " << i << " on rank " << comm->rank();
    // Parameters 2s, 2s+1 (weight, bias) belong to stage s.
    auto params = model->parameters();
    for (int s : schedule.stages_of(comm->rank()))
      for (int k : {2 * s, 2 * s + 1}) {
        ASSERT_TRUE(params[k].grad().defined()) << "stage " << s;
        expect_close(params[k].grad(), ref.grads[k],
                     "stage " + std::to_string(s) + " param " + std::to_string(k));
      }
  });
}

INSTANTIATE_TEST_SUITE_P(AllSchedules, PipelineEquivalence, ::testing::ValuesIn(all_cases()),
                         case_name);

// Two steps accumulate exactly twice one step's gradient: no scaling by
// the number of steps or micro-batches anywhere else.
TEST(PipelineRuntime, StepsAccumulateWithoutExtraScaling) {
  const int m = 4;
  const auto x = det({8, kWidth}, 0.3), y = det({8, kWidth}, 1.1);
  const Reference ref = reference_run(2, x, y, m);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_mlp(2);
    int r = comm->rank();
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                       {PipelineStage(r, split_sequential(model, {2}, r))}, Schedule1F1B(2, m),
                       mse);
    rt.step({x}, {y});
    rt.step({x}, {y});
    auto params = model->parameters();
    for (int k : {2 * r, 2 * r + 1}) expect_close(params[k].grad(), 2 * ref.grads[k], "param");
  });
}

// Each boundary carries (hidden, skip, mask): two floating-point tensors
// with gradients and an integer one without.
Tensors block(torch::nn::Linear lin, const Tensors& in) {
  auto h = torch::tanh(lin->forward(in[0])) + 0.5 * in[1];
  return {h * in[2].to(torch::kFloat32), in[0], in[2]};
}

TEST(PipelineRuntime, BoundaryOfSeveralTensors) {
  const int pp = 3, m = 3;
  auto make_layers = [] {
    std::vector<torch::nn::Linear> layers;
    torch::NoGradGuard g;
    for (int s = 0; s < pp; ++s) {
      torch::nn::Linear lin(kWidth, kWidth);
      lin->weight.copy_(det({kWidth, kWidth}, s));
      lin->bias.copy_(det({kWidth}, 5 + s));
      layers.push_back(lin);
    }
    return layers;
  };
  const auto x = det({6, kWidth}, 0.2), y = det({6, kWidth}, 0.9);
  const auto mask = (torch::arange(6 * kWidth).reshape({6, kWidth}) % 5 != 0).to(torch::kInt64);
  auto ref_layers = make_layers();
  Tensors t{x, x, mask};
  for (auto& l : ref_layers) t = block(l, t);
  torch::nn::functional::mse_loss(t[0], y).backward();

  run_ranks_shared(pp, [&](std::shared_ptr<Communicator> comm) {
    auto layers = make_layers();
    int r = comm->rank();
    auto lin = layers[r];
    PipelineStage stage(
        r, [lin](const Tensors& in) { return block(lin, in); }, lin->parameters(), lin.ptr());
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), {stage}, ScheduleZBH1(pp, m),
                       mse);
    auto res = rt.step({x, x, mask}, {y});
    expect_close(lin->weight.grad(), ref_layers[r]->weight.grad(), "weight");
    expect_close(lin->bias.grad(), ref_layers[r]->bias.grad(), "bias");
  });
}

// --- errors: each a clear exception, never a hang ---------------------------

std::string error_text(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

cohort::testing::ThreadRanksOptions quick() {
  cohort::testing::ThreadRanksOptions o;
  o.timeout = std::chrono::seconds(3);
  return o;
}

TEST(PipelineRuntime, RefusesBadSetup) {
  // Schedule-level errors, before any communication.
  EXPECT_NE(error_text([] { ScheduleInterleaved1F1B(2, 2, 3); }).find("multiple of pp"),
            std::string::npos);
  EXPECT_NE(error_text([] { Schedule1F1B(2, 0); }).find("must be positive"), std::string::npos);
  EXPECT_THROW(split_sequential(make_mlp(2), {0}, 0), InvalidArgument);
  EXPECT_THROW(partition_balanced({1, 2}, 3), InvalidArgument);

  // An empty stage list on one rank: both ranks get an error, each its own.
  std::string seen[2];
  run_ranks_shared(
      2,
      [&](std::shared_ptr<Communicator> comm) {
        auto model = make_mlp(2);
        std::vector<PipelineStage> mine;
        if (comm->rank() == 0) mine.emplace_back(0, split_sequential(model, {2}, 0));
        seen[comm->rank()] = error_text([&] {
          PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine),
                             Schedule1F1B(2, 2), mse);
        });
      },
      quick());
  EXPECT_NE(seen[0].find("rank 1 refused the pipeline"), std::string::npos) << seen[0];
  EXPECT_NE(seen[1].find("rank 1 of group world: empty stage list"), std::string::npos) << seen[1];
  std::string e;

  // Zero micro-batches.
  e = error_text([] {
    run_ranks_shared(1, [](std::shared_ptr<Communicator> comm) {
      auto s = Schedule1F1B(1, 1);
      s.num_microbatches = 0;
      PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                         {PipelineStage(0, make_mlp(1))}, s, mse);
    });
  });
  EXPECT_NE(e.find("zero micro-batches"), std::string::npos) << e;

  // Ranks that disagree on the number of stages.
  e = error_text([] {
    run_ranks_shared(
        2,
        [](std::shared_ptr<Communicator> comm) {
          auto model = make_mlp(4);
          int r = comm->rank();
          if (r == 0) {
            PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                               {PipelineStage(0, split_sequential(model, {2}, 0))},
                               Schedule1F1B(2, 2), mse);
          } else {
            std::vector<PipelineStage> mine;
            mine.emplace_back(1, split_sequential(model, {2, 4, 6}, 1));
            mine.emplace_back(3, split_sequential(model, {2, 4, 6}, 3));
            PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine),
                               ScheduleInterleaved1F1B(2, 2, 2), mse);
          }
        },
        quick());
  });
  EXPECT_NE(e.find("ranks disagree on the pipeline"), std::string::npos) << e;

  // A rank holding a stage the schedule does not give it: that rank names
  // the cause, the other says which rank refused.
  std::vector<std::string> per_rank(2);
  e = error_text([&] {
    run_ranks_shared(
        2,
        [&](std::shared_ptr<Communicator> comm) {
          auto model = make_mlp(2);
          per_rank[comm->rank()] = error_text([&] {
            PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                               {PipelineStage(0, split_sequential(model, {2}, 0))},
                               Schedule1F1B(2, 2), mse);
          });
        },
        quick());
  });
  EXPECT_NE(per_rank[1].find("holds stages [0], the schedule maps [1]"), std::string::npos)
      << per_rank[1];
  EXPECT_NE(per_rank[0].find("rank 1 refused the pipeline"), std::string::npos) << per_rank[0];
}

TEST(PipelineRuntime, RefusesBatchThatDoesNotSplit) {
  std::string e = error_text([] {
    run_ranks_shared(1, [](std::shared_ptr<Communicator> comm) {
      PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                         {PipelineStage(0, make_mlp(1))}, ScheduleGPipe(1, 4), mse);
      rt.step({det({6, kWidth}, 0)}, {det({6, kWidth}, 1)});
    });
  });
  EXPECT_NE(e.find("a batch of 6 inputs does not split into 4 micro-batches"), std::string::npos)
      << e;
}

TEST(PipelineRuntime, DeadPeerIsReportedWithinTheTimeout) {
  auto t0 = std::chrono::steady_clock::now();
  std::string e = error_text([] {
    run_ranks_shared(
        2,
        [](std::shared_ptr<Communicator> comm) {
          auto model = make_mlp(2);
          int r = comm->rank();
          PipelineOptions o;
          o.timeout = std::chrono::seconds(1);
          PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                             {PipelineStage(r, split_sequential(model, {2}, r))},
                             Schedule1F1B(2, 2), mse, o);
          if (r == 1) return;  // rank 1 dies before the step
          rt.step({det({4, kWidth}, 0)}, {});
        },
        quick());
  });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Rank 0 finds the closed connections at the step's first collective (the
  // batch check): the error names the operation and the peer.
  EXPECT_NE(e.find("all_gather_into_tensor on rank 0 of 2"), std::string::npos) << e;
  EXPECT_NE(e.find("peer 1"), std::string::npos) << e;
  EXPECT_LT(s, 20.0);
}

TEST(PipelineStages, BalancedBoundaries) {
  EXPECT_EQ(partition_balanced({1, 1, 1, 1}, 2), (std::vector<int64_t>{2}));
  EXPECT_EQ(partition_balanced({4, 1, 1, 1, 1}, 2), (std::vector<int64_t>{1}));
  EXPECT_EQ(partition_balanced({1, 2, 3, 4, 5, 6}, 3), (std::vector<int64_t>{3, 5}));
  torch::nn::Sequential seq(torch::nn::Linear(10, 10), torch::nn::ReLU(), torch::nn::Linear(10, 2),
                            torch::nn::Linear(2, 2));
  // 110 | 0 + 22 + 6 parameter elements.
  EXPECT_EQ(balance_by_parameters(seq, 2), (std::vector<int64_t>{1}));
  auto b = balance_by_time(make_mlp(4), det({4, kWidth}, 0), 4, 1);
  EXPECT_EQ(b.size(), 3u);
  EXPECT_TRUE(std::is_sorted(b.begin(), b.end()));
}

// Stages exchange activations along one dimension: a whole 2-D mesh is
// refused on every rank, naming the mesh; its "pp" slice runs the pipeline.
TEST(PipelineRuntime, MeshThatIsNotOneDimensionalIsRefused) {
  run_ranks_shared(2, [](std::shared_ptr<Communicator> comm) {
    auto mesh = init_device_mesh(comm, {1, 2}, {"dp", "pp"});
    const int r = comm->rank();
    auto model = make_mlp(2);
    auto stages = [&] { return std::vector{PipelineStage(r, split_sequential(model, {2}, r))}; };
    std::string m = "no error";
    try {
      PipelineRuntime rt(mesh, stages(), Schedule1F1B(2, 2), mse);
    } catch (const InvalidArgument& e) {
      m = e.what();
    }
    EXPECT_NE(m.find("PipelineRuntime on rank " + std::to_string(r) +
                     ": the mesh must be 1-D (mesh[\"pp\"])"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("dp=1 pp=2"), std::string::npos) << m;
    PipelineRuntime rt(mesh["pp"], stages(), Schedule1F1B(2, 2), mse);
    EXPECT_EQ(rt.process_group(), mesh["pp"].process_group());
  });
}

}  // namespace
}  // namespace cohort::pipeline::runtime_test
