// The Trainer driving a pipeline (ranks as threads): with clipping by the
// global norm over all stages it takes the same steps as one process on the
// whole batch (pipeline alone and pipeline x data parallel), its metrics
// report that loss and the traffic of every group, and a resumed run is
// bitwise the uninterrupted one.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <utility>

#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline_trainer_test {
namespace {

using pipeline::Tensors;

constexpr int64_t kWidth = 6, kMicro = 2;
constexpr double kLr = 0.05, kMaxNorm = 0.05;

struct Case {
  const char* schedule;  // make_schedule's names
  int pp, v, dp, m;
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.schedule) + "_pp" + std::to_string(c.pp) + "_v" + std::to_string(c.v) +
         "_dp" + std::to_string(c.dp) + "_m" + std::to_string(c.m);
}

// Deterministic values (no generator: ranks on threads build identical models).
torch::Tensor det(std::vector<int64_t> shape, double phase) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return torch::sin(torch::arange(n, torch::kFloat32) * 0.37 + phase).reshape(shape) * 0.5;
}

// `stages` blocks of (Linear, Tanh); `phase` shifts every weight.
torch::nn::Sequential make_model(int stages, double phase = 0) {
  torch::nn::Sequential seq;
  torch::NoGradGuard no_grad;
  for (int s = 0; s < stages; ++s) {
    torch::nn::Linear lin(kWidth, kWidth);
    lin->weight.copy_(det({kWidth, kWidth}, s + phase));
    lin->bias.copy_(det({kWidth}, 10 + s + phase));
    seq->push_back(lin);
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

torch::optim::SGD make_sgd(std::vector<torch::Tensor> params) {
  return torch::optim::SGD(std::move(params), torch::optim::SGDOptions(kLr).momentum(0.9));
}

int64_t global_batch(const Case& c) { return c.dp * c.m * kMicro; }

// Micro-batch `index` of all replicas together is rows [index * g,
// (index + 1) * g) of the data, g = dp micro-batches (so step s reads the
// global batch s at any layout); replica r's is the r-th micro-batch of
// those, and every rank of a pipeline reads its replica's.
class ReplicaSource : public DataSource {
 public:
  ReplicaSource(torch::Tensor x, torch::Tensor y, const Case& c, int replica)
      : x_(std::move(x)), y_(std::move(y)), c_(c), replica_(replica) {}
  void set_epoch(int64_t) override {}
  int64_t num_batches() const override { return x_.size(0) / global_batch(c_) * c_.m; }
  int64_t global_micro_batch() const override { return c_.dp * kMicro; }
  torch::data::Example<> batch(int64_t index) override {
    const int64_t start = (index * c_.dp + replica_) * kMicro;
    return {x_.narrow(0, start, kMicro), y_.narrow(0, start, kMicro)};
  }

 private:
  torch::Tensor x_, y_;
  Case c_;
  int replica_;
};

struct Reference {
  std::vector<double> losses, norms;
  std::vector<torch::Tensor> params;
};

// One process, the whole global batch per step, clip_grad_norm_, SGD.
Reference reference_run(const Case& c, const torch::Tensor& x, const torch::Tensor& y) {
  auto model = make_model(c.pp * c.v);
  auto opt = make_sgd(model->parameters());
  Reference ref;
  const int64_t global = global_batch(c), steps = x.size(0) / global;
  for (int64_t s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto loss = torch::nn::functional::mse_loss(model->forward(x.narrow(0, s * global, global)),
                                                y.narrow(0, s * global, global));
    loss.backward();
    ref.norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm));
    opt.step();
    ref.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model->parameters()) ref.params.push_back(p.detach().clone());
  return ref;
}

struct Job {
  Case c;
  std::string dir;  // checkpoints; empty: none
  int64_t max_steps = 0;
  bool resume = false;
  std::string metrics;
};

// What one rank saw: the metrics of its steps, and its stages' parameters
// by their index in the whole model.
struct RankRun {
  std::vector<StepMetrics> metrics;
  std::map<int64_t, torch::Tensor> params;
};

// Rank = dp_rank * pp + pp_rank (the "dp" x "pp" mesh); with dp 1 the
// pipeline group spans the world.
RankRun run_rank(const Job& job, std::shared_ptr<Communicator> world, const torch::Tensor& x,
                 const torch::Tensor& y) {
  torch::set_num_threads(1);
  const Case& c = job.c;
  const int pp_rank = world->rank() % c.pp, dp_rank = world->rank() / c.pp;
  const auto mesh = init_device_mesh(world, {c.dp, c.pp}, {"dp", "pp"});
  auto model = make_model(c.pp * c.v, job.resume ? 0.5 : 0.0);  // resume overwrites it
  const auto schedule = pipeline::make_schedule(c.schedule, c.pp, c.v, c.m);
  std::vector<int64_t> boundaries;
  for (int s = 1; s < schedule.num_stages; ++s) boundaries.push_back(2 * s);
  std::vector<pipeline::PipelineStage> stages;
  for (int s : schedule.stages_of(pp_rank))
    stages.emplace_back(s, pipeline::split_sequential(model, boundaries, s));
  auto mse = [](const Tensors& out, const Tensors& t) {
    return torch::nn::functional::mse_loss(out[0], t[0]);
  };
  pipeline::PipelineRuntime rt(mesh["pp"], std::move(stages), schedule, mse);
  auto opt = make_sgd(rt.parameters());
  auto wiring =
      c.dp > 1 ? TrainerWiring::pipeline(rt, opt, mesh) : TrainerWiring::pipeline(rt, opt);
  TrainerOptions config;
  config.accumulation_steps = c.m;
  config.max_grad_norm = kMaxNorm;
  config.schedule.base_lr = kLr;
  config.max_steps = job.max_steps;
  config.checkpoint_dir = job.dir;
  config.checkpoint_every = 2;
  config.metrics_path = job.metrics;
  config.progress = false;
  Trainer trainer(std::move(wiring), config);
  if (job.resume) {
    EXPECT_TRUE(trainer.resume().has_value());
  }
  ReplicaSource source(x, y, c, dp_rank);
  RankRun run;
  run.metrics = trainer.fit(source);
  const auto params = model->parameters();
  for (int s : schedule.stages_of(pp_rank))
    for (int64_t k : {2 * s, 2 * s + 1}) run.params[k] = params[k].detach().clone();
  return run;
}

std::vector<RankRun> run_job(const Job& job, const torch::Tensor& x, const torch::Tensor& y) {
  std::vector<RankRun> runs(static_cast<size_t>(job.c.pp * job.c.dp));
  std::mutex mu;
  testing::run_ranks_shared(job.c.pp * job.c.dp, [&](std::shared_ptr<Communicator> world) {
    RankRun run = run_rank(job, world, x, y);
    std::lock_guard<std::mutex> lock(mu);
    runs[static_cast<size_t>(world->rank())] = std::move(run);
  });
  return runs;
}

bool close(double a, double b) { return std::abs(a - b) <= 1e-5 * std::abs(b); }

std::vector<double> logged_losses(const std::string& path) {
  std::vector<double> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  }
  return out;
}

// What rank `rank` sends in a step at least: each of its stages'
// activations forward (but the last stage's) and input gradients back (but
// the first's); with dp > 1 also its stages' gradients, all-reduced over the
// data-parallel group (a ring sends 2(p-1)/p of them). Above that only
// scalars (the norm) and, on the first step, the boundaries' shapes.
int64_t min_bytes_sent(const Case& c, int rank) {
  const auto schedule = pipeline::make_schedule(c.schedule, c.pp, c.v, c.m);
  const int64_t activations = c.m * kMicro * kWidth * 4;
  int64_t bytes = 0, grads = 0;
  for (int s : schedule.stages_of(rank % c.pp)) {
    bytes += (int64_t{s < schedule.num_stages - 1} + int64_t{s > 0}) * activations;
    grads += (kWidth * kWidth + kWidth) * 4;
  }
  return bytes + 2 * (c.dp - 1) * grads / c.dp;
}

class PipelineTrainer : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineTrainer, EqualsOneProcessWithGlobalNormClipping) {
  const Case c = GetParam();
  constexpr int64_t kSteps = 3;
  const auto x = det({kSteps * global_batch(c), kWidth}, 0.4);
  const auto y = det({kSteps * global_batch(c), kWidth}, 1.3);
  const Reference ref = reference_run(c, x, y);
  testing::TempDir dir("cohort-pipe-trainer");
  const auto runs = run_job({c, "", 0, false, dir / "m.jsonl"}, x, y);
  for (size_t r = 0; r < runs.size(); ++r) {
    ASSERT_EQ(runs[r].metrics.size(), static_cast<size_t>(kSteps));
    for (size_t s = 0; s < static_cast<size_t>(kSteps); ++s) {
      const StepMetrics& m = runs[r].metrics[s];
      ASSERT_GT(ref.norms[s], kMaxNorm) << "the test must exercise clipping";
      EXPECT_TRUE(m.clipped) << "rank " << r << ", step " << s;
      EXPECT_TRUE(close(m.grad_norm, ref.norms[s])) << m.grad_norm << " vs " << ref.norms[s];
      EXPECT_TRUE(close(m.loss, ref.losses[s])) << m.loss << " vs " << ref.losses[s];
      EXPECT_EQ(m.samples, global_batch(c));
      // Every group's traffic counts: the pipeline's, the data-parallel one's.
      const int64_t least = min_bytes_sent(c, static_cast<int>(r));
      EXPECT_GE(m.comm_bytes, least) << "rank " << r << ", step " << s;
      EXPECT_LE(m.comm_bytes, least + 4096) << "rank " << r << ", step " << s;
      if (c.pp * c.dp > 1) {
        EXPECT_GT(m.comm_seconds, 0.0) << "rank " << r << ", step " << s;
        EXPECT_LE(m.comm_seconds, m.step_seconds) << "rank " << r << ", step " << s;
      }
    }
    for (const auto& [k, p] : runs[r].params) {
      const double scale = ref.params[k].abs().max().item<double>();
      EXPECT_LE((p - ref.params[k]).abs().max().item<double>(), 1e-5 * scale)
          << "parameter " << k << " on rank " << r;
    }
  }
  // Rank 0 holds the first stage; its metrics file has the last stage's loss.
  const auto logged = logged_losses(dir / "m.jsonl");
  ASSERT_EQ(logged.size(), static_cast<size_t>(kSteps));
  for (size_t s = 0; s < static_cast<size_t>(kSteps); ++s)
    EXPECT_TRUE(close(logged[s], ref.losses[s])) << s;
}

INSTANTIATE_TEST_SUITE_P(Trainer, PipelineTrainer,
                         ::testing::Values(Case{"1f1b", 1, 1, 1, 2}, Case{"1f1b", 2, 1, 1, 3},
                                           Case{"zbh1", 2, 1, 2, 2}, Case{"gpipe", 3, 1, 1, 3},
                                           Case{"interleaved", 2, 2, 1, 4}),
                         name_of);

// A pipeline wires with LibTorch optimizers over its stages only: the fused
// optimizer and ZeRO reduce over their own communicator, not the stages'.
template <typename O, typename = void>
struct WiresPipeline : std::false_type {};
template <typename O>
struct WiresPipeline<O, std::void_t<decltype(TrainerWiring::pipeline(
                            std::declval<pipeline::PipelineRuntime&>(), std::declval<O&>()))>>
    : std::true_type {};
static_assert(WiresPipeline<torch::optim::SGD>::value, "a pipeline + a LibTorch optimizer");
static_assert(!WiresPipeline<FusedDistributedOptimizer>::value, "not the fused optimizer");
static_assert(!WiresPipeline<ZeroRedundancyOptimizer>::value, "not ZeRO");

// A LossFn next to a pipeline, or accumulation steps other than the
// schedule's micro-batches, are refused when the trainer is made.
TEST(PipelineTrainerErrors, RefusesALossFnAndAMismatchedAccumulation) {
  testing::run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    auto model = make_model(1);
    auto mse = [](const Tensors& out, const Tensors& t) {
      return torch::nn::functional::mse_loss(out[0], t[0]);
    };
    pipeline::PipelineRuntime rt(cohort::DeviceMesh::from_group(world, "pp"),
                                 {pipeline::PipelineStage(0, model)}, pipeline::Schedule1F1B(1, 2),
                                 mse);
    auto opt = make_sgd(rt.parameters());
    TrainerOptions config;
    config.accumulation_steps = 2;
    config.progress = false;
    LossFn loss = [](const torch::data::Example<>&) { return torch::zeros({}); };
    EXPECT_THROW({ Trainer trainer(TrainerWiring::pipeline(rt, opt), loss, config); },
                 InvalidArgument);
    config.accumulation_steps = 3;
    try {
      Trainer trainer(TrainerWiring::pipeline(rt, opt), config);
      ADD_FAILURE() << "accumulation_steps 3 with m 2 was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("2 micro-batches"), std::string::npos) << e.what();
    }
  });
}

class PipelineTrainerResume : public ::testing::TestWithParam<Case> {};

// Every rank writes its stages' parameters and optimizer state into the
// checkpoint's dcp folder (no per-rank files); resuming at step 2
// reproduces steps 3 and 4 bit for bit.
TEST_P(PipelineTrainerResume, IsBitwiseIdentical) {
  const Case c = GetParam();
  const auto x = det({4 * global_batch(c), kWidth}, 0.4);
  const auto y = det({4 * global_batch(c), kWidth}, 1.3);
  testing::TempDir whole("cohort-pipe-whole"), split("cohort-pipe-split");
  const auto uninterrupted = run_job({c, whole.str(), 4, false, ""}, x, y);
  run_job({c, split.str(), 2, false, ""}, x, y);
  const std::string main_file = CheckpointDir(split.str(), 3).path_for(2);
  EXPECT_TRUE(std::filesystem::exists(main_file + ".dcp/.metadata")) << main_file;
  for (const auto& entry : std::filesystem::directory_iterator(split.str())) {
    EXPECT_EQ(entry.path().string().find(".shard-"), std::string::npos) << entry.path();
  }
  const auto resumed = run_job({c, split.str(), 4, true, ""}, x, y);
  for (size_t r = 0; r < resumed.size(); ++r) {
    ASSERT_EQ(resumed[r].metrics.size(), 2u);
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(resumed[r].metrics[s].loss, uninterrupted[r].metrics[2 + s].loss);
      EXPECT_EQ(resumed[r].metrics[s].grad_norm, uninterrupted[r].metrics[2 + s].grad_norm);
    }
    for (const auto& [k, p] : resumed[r].params) {
      EXPECT_TRUE(torch::equal(p, uninterrupted[r].params.at(k))) << "parameter " << k;
    }
  }
}

// The checkpoint names the tensors by stage, so it resumes over another
// number of ranks, pipeline size and schedule with the same stages and
// global batch, continuing the run that kept its layout within 1e-5.
TEST(PipelineTrainerReshard, ContinuesAtAnotherLayout) {
  const std::pair<Case, Case> moves[] = {
      {Case{"zbh1", 2, 1, 2, 2}, Case{"1f1b", 2, 1, 1, 4}},           // world 4 -> 2
      {Case{"interleaved", 2, 2, 1, 2}, Case{"gpipe", 4, 1, 1, 2}}};  // world 2 -> 4
  for (const auto& [from, to] : moves) {
    SCOPED_TRACE(std::string(from.schedule) + " -> " + to.schedule);
    ASSERT_EQ(global_batch(from), global_batch(to));
    const auto x = det({4 * global_batch(from), kWidth}, 0.4);
    const auto y = det({4 * global_batch(from), kWidth}, 1.3);
    testing::TempDir whole("cohort-pipe-whole"), split("cohort-pipe-split");
    const auto uninterrupted = run_job({from, whole.str(), 4, false, ""}, x, y);
    run_job({from, split.str(), 2, false, ""}, x, y);
    const auto resumed = run_job({to, split.str(), 4, true, ""}, x, y);
    std::map<int64_t, torch::Tensor> want, got;
    for (const auto& r : uninterrupted) want.insert(r.params.begin(), r.params.end());
    for (size_t r = 0; r < resumed.size(); ++r) {
      ASSERT_EQ(resumed[r].metrics.size(), 2u);
      for (size_t s = 0; s < 2; ++s) {
        const double loss = uninterrupted[0].metrics[2 + s].loss;
        EXPECT_TRUE(close(resumed[r].metrics[s].loss, loss))
            << "rank " << r << ", step " << 3 + s << ": " << resumed[r].metrics[s].loss << " vs "
            << loss;
      }
      got.insert(resumed[r].params.begin(), resumed[r].params.end());
    }
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [k, p] : got) {
      const double scale = want.at(k).abs().max().item<double>();
      EXPECT_LE((p - want.at(k)).abs().max().item<double>(), 1e-5 * scale) << "parameter " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, PipelineTrainerResume,
                         ::testing::Values(Case{"zbh1", 2, 1, 2, 2},
                                           Case{"interleaved", 2, 2, 1, 2}),
                         name_of);

}  // namespace
}  // namespace cohort::pipeline_trainer_test
