// The Trainer over a pipeline whose first, last and (from three stages)
// second stage hold copies of one tied weight, declared with
// PipelineStage::tie (tests/pipeline/pipeline_test_models.h): with AdamW and
// clipping by the global norm it takes the steps of one process holding the
// one weight (the norm counts the weight once, after its copies' gradients
// were summed), pipeline alone, pipeline x data parallel, and over a mesh
// (TrainerWiring::mesh with its GradientSynchronizer); the checkpoint writes
// the weight once, and a resumed run is bitwise the uninterrupted one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "cohort/dcp/dcp.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "pipeline/pipeline_test_models.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline_tied_weights_test {
namespace {

using namespace cohort::pipeline::testing;
using pipeline::Tensors;

constexpr int64_t kMicro = 2;
constexpr double kLr = 0.05, kMaxNorm = 0.05;

struct Case {
  const char* schedule;
  int pp, v, dp, m;
  bool mesh = false;  // TrainerWiring::mesh over {"dp", "pp", "tp"} (tp 1), not ::pipeline
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.schedule) + "_pp" + std::to_string(c.pp) + "_v" + std::to_string(c.v) +
         "_dp" + std::to_string(c.dp) + "_m" + std::to_string(c.m) + (c.mesh ? "_mesh" : "");
}

int64_t global_batch(const Case& c) { return c.dp * c.m * kMicro; }

torch::optim::AdamW adamw(std::vector<torch::Tensor> params) {
  return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(kLr).weight_decay(0.1));
}

// Each step's norm and the tensors by name: "w" (each copy reports it),
// "a<stage>", "b<stage>".
struct TiedRun {
  std::vector<double> norms, losses;
  std::map<std::string, torch::Tensor> params;
};

void add_stage(TiedRun& run, int s, const TiedParams& p) {
  if (p.a.defined()) run.params["a" + std::to_string(s)] = p.a.detach().clone();
  if (p.b.defined()) run.params["b" + std::to_string(s)] = p.b.detach().clone();
}

// One process, the global batch per step, clip_grad_norm_ over each tensor once, AdamW.
TiedRun reference_run(int stages, int64_t batch, int steps, const torch::Tensor& x,
                      const torch::Tensor& y) {
  auto ref = tied_reference(stages);
  auto opt = adamw(ref.parameters());
  TiedRun run;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto loss = torch::nn::functional::mse_loss(ref.forward(x.narrow(0, s * batch, batch)),
                                                y.narrow(0, s * batch, batch));
    loss.backward();
    run.norms.push_back(torch::nn::utils::clip_grad_norm_(ref.parameters(), kMaxNorm));
    run.losses.push_back(loss.item<double>());
    opt.step();
  }
  run.params["w"] = ref.w.detach().clone();
  for (int s = 0; s < stages; ++s) add_stage(run, s, ref.stage[s]);
  return run;
}

struct Job {
  Case c;
  std::string dir;  // checkpoints; empty: none
  int64_t max_steps = 0;
  bool resume = false;
};

// This rank's stage tensors as one module, for the mesh's synchronizer
// (the stages are functions). It keeps no tied embedding of its own: W is
// kept through the stages' declarations.
std::unique_ptr<GradientSynchronizer> mesh_sync(const DeviceMesh& mesh,
                                                const pipeline::PipelineRuntime& rt) {
  auto holder = std::make_shared<torch::nn::Module>("Stages");
  for (size_t i = 0; i < rt.parameters().size(); ++i)
    holder->register_parameter("p" + std::to_string(i), rt.parameters()[i]);
  GradientSynchronizerOptions options;
  options.untied_embedding = true;
  return std::make_unique<GradientSynchronizer>(mesh, holder, std::vector<torch::Tensor>{},
                                                torch::Tensor(), options);
}

// Rank = dp_rank * pp + pp_rank. Every stage builds its own tensors, its
// copy of W off by 0.25 * stage (the runtime broadcasts stage 0's).
TiedRun run_rank(const Job& job, std::shared_ptr<Communicator> world, const torch::Tensor& x,
                 const torch::Tensor& y) {
  torch::set_num_threads(1);
  const Case& c = job.c;
  const int pp_rank = world->rank() % c.pp, dp_rank = world->rank() / c.pp;
  const auto mesh = c.mesh ? init_device_mesh(world, {c.dp, c.pp, 1}, {"dp", "pp", "tp"})
                           : init_device_mesh(world, {c.dp, c.pp}, {"dp", "pp"});
  const auto schedule = pipeline::make_schedule(c.schedule, c.pp, c.v, c.m);
  const int stages = schedule.num_stages;
  std::vector<pipeline::PipelineStage> mine;
  std::map<int, TiedParams> params;
  for (int s : schedule.stages_of(pp_rank)) {
    mine.push_back(tied_stage(s, stages, job.resume ? 0.5 : 0.25));
    const auto& p = mine.back().parameters();
    TiedParams t = tied_params(s, stages);
    size_t i = 0;
    for (auto* slot : {&t.w, &t.a, &t.b})
      if (slot->defined()) *slot = p[i++];
    if (job.resume) {  // the checkpoint overwrites them
      torch::NoGradGuard no_grad;
      for (auto& q : p) q.add_(0.5);
    }
    params[s] = t;
  }
  pipeline::PipelineRuntime rt(mesh["pp"], std::move(mine), schedule, mse);
  auto opt = adamw(rt.parameters());
  std::unique_ptr<GradientSynchronizer> sync;
  if (c.mesh) sync = mesh_sync(mesh, rt);
  auto wiring = c.mesh     ? TrainerWiring::mesh(mesh, rt, opt, *sync)
                : c.dp > 1 ? TrainerWiring::pipeline(rt, opt, mesh)
                           : TrainerWiring::pipeline(rt, opt);
  TrainerOptions config;
  config.accumulation_steps = c.m;
  config.max_grad_norm = kMaxNorm;
  config.schedule.base_lr = kLr;
  config.max_steps = job.max_steps;
  config.checkpoint_dir = job.dir;
  config.checkpoint_every = 2;
  config.progress = false;
  Trainer trainer(std::move(wiring), config);
  if (job.resume) {
    EXPECT_TRUE(trainer.resume().has_value());
  }
  TensorDataSource source(x, y, kMicro, dp_rank, c.dp, /*shuffle=*/false);
  TiedRun run;
  for (const auto& m : trainer.fit(source)) {
    run.norms.push_back(m.grad_norm);
    run.losses.push_back(m.loss);
  }
  for (const auto& [s, p] : params) {
    if (p.w.defined()) run.params["w@" + std::to_string(s)] = p.w.detach().clone();
    add_stage(run, s, p);
  }
  return run;
}

std::map<int, TiedRun> run_job(const Job& job, const torch::Tensor& x, const torch::Tensor& y) {
  return cohort::testing::results_of_ranks<TiedRun>(
      job.c.pp * job.c.dp,
      [&](std::shared_ptr<Communicator> world) { return run_rank(job, world, x, y); });
}

class PipelineTiedWeights : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineTiedWeights, EqualsOneProcessWithClipping) {
  const Case c = GetParam();
  constexpr int kSteps = 3;
  const auto schedule = pipeline::make_schedule(c.schedule, c.pp, c.v, c.m);
  const auto x = det({kSteps * global_batch(c), kWidth}, 0.4);
  const auto y = det({kSteps * global_batch(c), kWidth}, 1.3);
  const TiedRun ref = reference_run(schedule.num_stages, global_batch(c), kSteps, x, y);
  const auto runs = run_job({c, "", 0, false}, x, y);
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.pp * c.dp));
  int copies = 0;
  for (const auto& [rank, run] : runs) {
    const std::string where = "rank " + std::to_string(rank);
    ASSERT_EQ(run.norms.size(), static_cast<size_t>(kSteps)) << where;
    for (int s = 0; s < kSteps; ++s) {
      ASSERT_GT(ref.norms[s], kMaxNorm) << "the test must exercise clipping";
      EXPECT_NEAR(run.norms[s], ref.norms[s], 1e-5 * ref.norms[s]) << where << ", step " << s;
      EXPECT_NEAR(run.losses[s], ref.losses[s], 1e-5 * ref.losses[s]) << where << ", step " << s;
    }
    for (const auto& [name, t] : run.params) {
      const bool copy = name.rfind("w@", 0) == 0;
      copies += copy;
      const torch::Tensor& want = ref.params.at(copy ? "w" : name);
      const double err = (t - want).abs().max().item<double>();
      EXPECT_LE(err, 1e-5 * want.abs().max().item<double>()) << where << ", " << name;
    }
  }
  const int stages = schedule.num_stages;
  EXPECT_EQ(copies, (stages >= 3 ? 3 : stages) * c.dp);
}

INSTANTIATE_TEST_SUITE_P(
    Trainer, PipelineTiedWeights,
    ::testing::Values(Case{"1f1b", 1, 1, 1, 2}, Case{"1f1b", 2, 1, 1, 2}, Case{"gpipe", 3, 1, 1, 3},
                      Case{"zbh1", 2, 1, 2, 2}, Case{"interleaved", 2, 2, 1, 4},
                      Case{"1f1b", 1, 1, 2, 2, true}, Case{"1f1b", 2, 1, 2, 2, true},
                      Case{"gpipe", 3, 1, 1, 3, true}, Case{"interleaved", 2, 2, 2, 4, true}),
    name_of);

class PipelineTiedWeightsResume : public ::testing::TestWithParam<Case> {};

// The checkpoint holds W once (stage 0's, under its name) and a resumed run
// that starts from other values reproduces steps 3 and 4 bit for bit.
TEST_P(PipelineTiedWeightsResume, WritesTheWeightOnceAndIsBitwiseIdentical) {
  const Case c = GetParam();
  const auto x = det({4 * global_batch(c), kWidth}, 0.4);
  const auto y = det({4 * global_batch(c), kWidth}, 1.3);
  cohort::testing::TempDir whole("cohort-tied-whole"), split("cohort-tied-split");
  const auto uninterrupted = run_job({c, whole.str(), 4, false}, x, y);
  run_job({c, split.str(), 2, false}, x, y);
  const auto meta = dcp::read_metadata(CheckpointDir(split.str(), 3).path_for(2) + ".dcp");
  const int last = pipeline::make_schedule(c.schedule, c.pp, c.v, c.m).num_stages - 1;
  EXPECT_NE(meta.find("model.stage0_0"), nullptr);
  EXPECT_EQ(meta.find("model.stage" + std::to_string(last) + "_0"), nullptr)
      << "the last stage's copy of W was written";
  const auto resumed = run_job({c, split.str(), 4, true}, x, y);
  for (const auto& [rank, run] : resumed) {
    const TiedRun& want = uninterrupted.at(rank);
    ASSERT_EQ(run.norms.size(), 2u);
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(run.losses[s], want.losses[2 + s]) << "rank " << rank << ", step " << 3 + s;
      EXPECT_EQ(run.norms[s], want.norms[2 + s]) << "rank " << rank << ", step " << 3 + s;
    }
    for (const auto& [name, t] : run.params) {
      EXPECT_TRUE(torch::equal(t, want.params.at(name))) << "rank " << rank << ", " << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, PipelineTiedWeightsResume,
                         ::testing::Values(Case{"gpipe", 3, 1, 1, 3}, Case{"zbh1", 2, 1, 2, 2},
                                           Case{"1f1b", 2, 1, 2, 2, true}),
                         name_of);

// W declared tied and passed to the mesh's synchronizer as its tied
// embedding too would be summed twice: refused on every rank.
TEST(PipelineTiedWeightsMesh, AWeightBothDeclaredAndTheSynchronizersEmbeddingIsRefused) {
  const auto errors = cohort::testing::results_of_ranks<std::string>(
      2, [](std::shared_ptr<Communicator> world) -> std::string {
        torch::set_num_threads(1);
        const auto mesh = init_device_mesh(world, {1, 2, 1}, {"dp", "pp", "tp"});
        const int s = mesh.local_rank("pp");
        pipeline::PipelineRuntime rt(mesh["pp"], {tied_stage(s, 2)},
                                     pipeline::make_schedule("1f1b", 2, 1, 2), mse);
        auto holder = std::make_shared<torch::nn::Module>("Stages");
        holder->register_parameter("w", rt.parameters()[0]);
        GradientSynchronizer sync(mesh, holder, {}, rt.parameters()[0]);
        auto opt = adamw(rt.parameters());
        try {
          TrainerWiring::mesh(mesh, rt, opt, sync);
        } catch (const InvalidArgument& e) {
          return e.what();
        }
        return "accepted";
      });
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& [rank, what] : errors)
    EXPECT_NE(what.find("shared_embedding is also declared tied as 'w'"), std::string::npos)
        << "rank " << rank << ": " << what;
}

}  // namespace
}  // namespace cohort::pipeline_tied_weights_test
