// The Trainer driving a TP x PP x DP mesh (TrainerWiring::mesh; ranks as
// threads) on the example GPT: its clipped global norm and loss equal one
// process's clip_grad_norm_ on the whole batch, it reports the traffic of
// each dimension and the time of its TP collectives, a run resumed from its
// distributed checkpoint is bitwise the uninterrupted one, and one resumed
// at another tp x pp x dp (and interleaving) continues the one-process run.
// An untied GPT (the output layer a table of its own) clips and trains as
// its one-process run too.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>

#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/pipeline/schedule.h"
#include "cohort/train/dcp_checkpoint.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"

namespace cohort::mesh_trainer_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kMicro = 2;   // micro-batches per step and DP rank
constexpr int64_t kBatch = 12;  // global, divides by dp x kMicro (dp 1, 2, 3)
constexpr double kLr = 0.1, kMaxNorm = 0.1;

struct Case {
  int tp, pp, dp;
  bool sp;
  int v = 1;            // model chunks per pipeline rank (interleaved when > 1)
  bool untied = false;  // GPTConfig::tie_embeddings false
};

// Two layers, or one per model chunk when there are more chunks.
int64_t layers_of(const Case& c) { return std::max<int64_t>(2, c.pp * c.v); }

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "tp" + std::to_string(c.tp) + "_pp" + std::to_string(c.pp) + "_dp" + std::to_string(c.dp) +
         (c.sp ? "_sp" : "") + (c.v > 1 ? "_v" + std::to_string(c.v) : "") +
         (c.untied ? "_untied" : "");
}

GPTConfig gpt_config(bool sp, int64_t layers, uint64_t seed = 7, double dropout = 0,
                     bool untied = false) {
  GPTConfig c;
  c.tie_embeddings = !untied;
  c.dropout = dropout;
  c.vocab_size = 8;
  c.seq_len = 4;
  c.hidden = 8;
  c.heads = 2;
  c.layers = layers;
  c.sequence_parallel = sp;
  c.seed = seed;
  return c;
}

// Step s's global batch: random ids, targets a fixed function of them.
std::pair<torch::Tensor, torch::Tensor> global_batch(int64_t s) {
  auto ids = torch::randint(8, {kBatch, 4}, at::detail::createCPUGenerator(100 + s));
  return {ids, (ids * 5 + 3) % 8};
}

// Micro-batch i of step s: the DP rank's rows of the step's batch, cut in kMicro.
class Batches : public DataSource {
 public:
  Batches(int dp, int dp_rank) : dp_(dp), dp_rank_(dp_rank) {}
  void set_epoch(int64_t) override {}
  int64_t num_batches() const override { return 100 * kMicro; }
  // Between steps (where checkpoints are) the micro-batches done over all
  // DP ranks are whole global batches, at any dp.
  int64_t global_micro_batch() const override { return kBatch / kMicro; }
  torch::data::Example<> batch(int64_t index) override {
    auto [ids, targets] = global_batch(index / kMicro);
    const int64_t rows = kBatch / dp_, micro = rows / kMicro;
    const int64_t start = dp_rank_ * rows + index % kMicro * micro;
    return {ids.narrow(0, start, micro), targets.narrow(0, start, micro)};
  }

 private:
  int dp_, dp_rank_;
};

torch::optim::SGD make_sgd(std::vector<torch::Tensor> params) {
  return torch::optim::SGD(std::move(params), torch::optim::SGDOptions(kLr).momentum(0.9));
}

struct Job {
  Case c;
  int64_t max_steps;
  std::string dir;  // checkpoints; empty: none
  bool resume = false;
  int64_t layers = 0;  // 0: layers_of(c)
  double dropout = 0;  // drawn from the stage's RngTracker, seeded by the model's seed
};

struct RankRun {
  std::vector<StepMetrics> metrics;
  std::map<std::string, torch::Tensor> params;
  std::set<std::string> replicated;  // the parameters the TP layers do not split
  int tp_rank = 0;
};

RankRun run_rank(const Job& job, std::shared_ptr<Communicator> world) {
  torch::set_num_threads(1);
  const Case& c = job.c;
  auto mesh = init_device_mesh(world, {c.pp, c.dp, c.tp}, {"pp", "dp", "tp"});
  // A resumed run starts from other weights: the checkpoint must replace them.
  GPTConfig config_of_model = gpt_config(c.sp, job.layers > 0 ? job.layers : layers_of(c),
                                         job.resume ? 8 : 7, job.dropout, c.untied);
  config_of_model.virtual_stages = c.v;
  GPTStage stage(mesh, config_of_model);
  cohort::GradientSynchronizerOptions sync_options;
  sync_options.untied_embedding = c.untied;
  cohort::GradientSynchronizer sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
                                    stage->shared_embedding_weight(), sync_options);
  auto rt = make_gpt_pipeline(mesh, stage, c.v > 1 ? "interleaved" : "1f1b", kMicro);
  auto opt = make_sgd(rt->parameters());
  TrainerOptions config;
  config.accumulation_steps = kMicro;
  config.max_grad_norm = kMaxNorm;
  config.schedule.base_lr = kLr;
  config.max_steps = job.max_steps;
  config.checkpoint_dir = job.dir;
  config.checkpoint_every = 2;
  config.progress = false;
  Trainer trainer(TrainerWiring::mesh(mesh, *rt, opt, sync,
                                      c.untied ? dcp::TiedNames{} : gpt_tied_parameters()),
                  config);
  if (job.resume) {
    EXPECT_TRUE(trainer.resume().has_value());
  }
  Batches source(c.dp, mesh.local_rank("dp"));
  RankRun run;
  run.metrics = trainer.fit(source);
  const auto split = split_dims(*stage);
  for (const auto& p : stage->named_parameters()) {
    run.params[p.key()] = p.value().detach().clone();
    if (!split.count(p.value().unsafeGetTensorImpl())) run.replicated.insert(p.key());
  }
  run.tp_rank = mesh.local_rank("tp");
  return run;
}

std::vector<RankRun> run_job(const Job& job) {
  const int world = job.c.tp * job.c.pp * job.c.dp;
  std::vector<RankRun> runs(static_cast<size_t>(world));
  std::mutex mu;
  testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    RankRun run = run_rank(job, comm);
    std::lock_guard<std::mutex> lock(mu);
    runs[static_cast<size_t>(comm->rank())] = std::move(run);
  });
  return runs;
}

struct Reference {
  std::vector<double> losses, norms;
};

// One process, one unsplit GPT, the whole global batch per step,
// clip_grad_norm_ and the same SGD.
Reference reference_run(bool sp, int64_t layers, int64_t steps, bool untied = false) {
  Reference ref;
  testing::run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {1, 1, 1}, {"pp", "dp", "tp"});
    GPTStage model(mesh, gpt_config(sp, layers, 7, 0, untied));
    auto opt = make_sgd(model->parameters());
    for (int64_t s = 0; s < steps; ++s) {
      auto [ids, targets] = global_batch(s);
      opt.zero_grad();
      auto loss = model->loss(model(ids), targets);
      loss.backward();
      ref.norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm));
      opt.step();
      ref.losses.push_back(loss.item<double>());
    }
  });
  return ref;
}

bool close(double a, double b) { return std::abs(a - b) <= 1e-5 * std::abs(b); }

class MeshTrainer : public ::testing::TestWithParam<Case> {};

TEST_P(MeshTrainer, ClipsByTheOneProcessGlobalNorm) {
  const Case c = GetParam();
  constexpr int64_t kSteps = 3;
  const Reference ref = reference_run(c.sp, layers_of(c), kSteps, c.untied);
  const auto runs = run_job({c, kSteps, ""});
  for (size_t r = 0; r < runs.size(); ++r) {
    ASSERT_EQ(runs[r].metrics.size(), static_cast<size_t>(kSteps));
    for (size_t s = 0; s < static_cast<size_t>(kSteps); ++s) {
      const StepMetrics& m = runs[r].metrics[s];
      ASSERT_GT(ref.norms[s], kMaxNorm) << "the test must exercise clipping";
      EXPECT_TRUE(m.clipped) << "rank " << r << ", step " << s;
      EXPECT_TRUE(close(m.grad_norm, ref.norms[s]))
          << "rank " << r << ", step " << s << ": " << m.grad_norm << " vs " << ref.norms[s];
      EXPECT_TRUE(close(m.loss, ref.losses[s])) << m.loss << " vs " << ref.losses[s];
      EXPECT_EQ(m.samples, kBatch);
      // Each dimension of more than one rank carries traffic, and the
      // dimensions are part of the step's total.
      int64_t dims = 0;
      for (const auto& [dim, bytes] : m.comm_bytes_by_dimension) {
        const int size = dim == "tp" ? c.tp : dim == "pp" ? c.pp : c.dp;
        EXPECT_EQ(bytes > 0, size > 1) << dim << " on rank " << r;
        dims += bytes;
      }
      EXPECT_EQ(m.comm_bytes_by_dimension.size(), 3u);
      EXPECT_LE(dims, m.comm_bytes);
      // The TP collectives in forward and backward are counted, apart from
      // the gradients' comm_seconds: exactly 0 without TP (none is issued).
      ASSERT_TRUE(m.tp_comm_seconds.has_value()) << "rank " << r << ", step " << s;
      if (c.tp > 1) {
        EXPECT_GT(*m.tp_comm_seconds, 0.0) << "rank " << r << ", step " << s;
      } else {
        EXPECT_EQ(*m.tp_comm_seconds, 0.0) << "rank " << r << ", step " << s;
      }
      EXPECT_LE(*m.tp_comm_seconds, m.step_seconds) << "rank " << r << ", step " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, MeshTrainer,
                         ::testing::Values(Case{1, 1, 1, false}, Case{2, 1, 1, true},
                                           Case{1, 2, 1, false}, Case{1, 1, 3, false},
                                           Case{2, 2, 2, false}, Case{2, 2, 2, true},
                                           Case{1, 1, 1, false, 2}, Case{1, 2, 1, false, 2},
                                           Case{2, 2, 2, false, 2}, Case{1, 2, 1, false, 1, true},
                                           Case{2, 2, 2, true, 1, true}),
                         name_of);

// Every rank saves its boxes of the model and optimizer state into the
// checkpoint's dcp folder; resumed at step 2 (from other initial weights),
// steps 3 and 4 are bit for bit the uninterrupted run's.
TEST(MeshTrainerResume, IsBitwiseIdenticalAtTp2Pp2Dp2) {
  const Case c{2, 2, 2, false};
  testing::TempDir whole("cohort-mesh-whole"), split("cohort-mesh-split");
  const auto uninterrupted = run_job({c, 4, whole.str()});
  run_job({c, 2, split.str()});
  const std::string folder = dcp_folder(CheckpointDir(split.str(), 3).path_for(2));
  EXPECT_TRUE(std::filesystem::exists(folder + "/.metadata")) << folder;
  const auto resumed = run_job({c, 4, split.str(), true});
  for (size_t r = 0; r < resumed.size(); ++r) {
    ASSERT_EQ(resumed[r].metrics.size(), 2u);
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(resumed[r].metrics[s].loss, uninterrupted[r].metrics[2 + s].loss);
      EXPECT_EQ(resumed[r].metrics[s].grad_norm, uninterrupted[r].metrics[2 + s].grad_norm);
    }
    ASSERT_EQ(resumed[r].params.size(), uninterrupted[r].params.size());
    for (const auto& [name, p] : resumed[r].params) {
      EXPECT_TRUE(torch::equal(p, uninterrupted[r].params.at(name))) << name << " on rank " << r;
    }
  }
}

// With dropout the masks come from each stage's RngTracker, which the
// checkpoint holds per rank: resumed at step 2 (from another seed, so other
// weights and other streams), steps 3 and 4 are bit for bit the
// uninterrupted run's. Without the streams in the checkpoint the resumed
// masks would be the new seed's.
TEST(MeshTrainerResume, ContinuesTheDropoutStreamsBitwise) {
  for (const Case c : {Case{2, 2, 2, false}, Case{2, 1, 1, true}}) {
    SCOPED_TRACE(name_of({c, 0}));
    testing::TempDir whole("cohort-mesh-dropout-whole"), split("cohort-mesh-dropout-split");
    Job job{c, 4, whole.str()};
    job.dropout = 0.2;
    const auto uninterrupted = run_job(job);
    job.dir = split.str();
    job.max_steps = 2;
    run_job(job);
    job.max_steps = 4;
    job.resume = true;
    const auto resumed = run_job(job);
    for (size_t r = 0; r < resumed.size(); ++r) {
      ASSERT_EQ(resumed[r].metrics.size(), 2u);
      for (size_t s = 0; s < 2; ++s) {
        EXPECT_EQ(resumed[r].metrics[s].loss, uninterrupted[r].metrics[2 + s].loss)
            << "rank " << r << ", step " << 2 + s;
      }
      for (const auto& [name, p] : resumed[r].params) {
        EXPECT_TRUE(torch::equal(p, uninterrupted[r].params.at(name))) << name << " on rank " << r;
      }
    }
  }
}

// Resumed at another layout the streams cannot continue (the TP groups and
// their ranks changed, or a rank is new): each TP group restarts its
// streams alike, so its replicated parameters stay bitwise equal.
TEST(MeshTrainerResume, ReshardedDropoutStreamsKeepTheReplicasEqual) {
  for (const auto& [from, to] : {std::pair{Case{1, 1, 2, false}, Case{2, 1, 1, false}},
                                 std::pair{Case{2, 1, 1, false}, Case{2, 1, 2, false}}}) {
    SCOPED_TRACE(name_of({from, 0}) + " to " + name_of({to, 0}));
    testing::TempDir dir("cohort-mesh-dropout-reshard");
    Job job{from, 2, dir.str()};
    job.dropout = 0.2;
    run_job(job);
    job.c = to;
    job.max_steps = 4;
    job.resume = true;
    const auto resumed = run_job(job);
    int compared = 0;
    for (size_t r = 0; r < resumed.size(); ++r) {
      const size_t first = r - static_cast<size_t>(resumed[r].tp_rank);  // TP rank 0 of its group
      for (const auto& name : resumed[r].replicated) {
        EXPECT_TRUE(torch::equal(resumed[r].params.at(name), resumed[first].params.at(name)))
            << name << " on rank " << r << " against rank " << first;
        ++compared;
      }
    }
    EXPECT_GT(compared, 0);
  }
}

// A model with fewer layers than the checkpoint's would load only its part:
// refused on every rank, naming a tensor it lacks, before anything loads.
TEST(MeshTrainerResume, RefusesAModelWithoutTheCheckpointsLayers) {
  const Case c{1, 2, 1, false};
  testing::TempDir dir("cohort-mesh-fewer");
  run_job({c, 2, dir.str(), false, 4});
  std::vector<std::string> errors(2);
  testing::run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    try {
      run_rank({c, 4, dir.str(), true, 2}, comm);
    } catch (const CheckpointError& e) {
      errors[static_cast<size_t>(comm->rank())] = e.what();
    }
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("holds model.block2."), std::string::npos) << e;
    EXPECT_NE(e.find("that this job's model does not have"), std::string::npos) << e;
  }
}

// Saved at one layout after 2 steps, resumed at another (from other initial
// weights) for steps 3 and 4: the losses and norms continue the one-process
// run, as an uninterrupted run at either layout does.
struct Reshard {
  Case from, to;
};

class MeshTrainerReshard : public ::testing::TestWithParam<Reshard> {};

TEST_P(MeshTrainerReshard, ContinuesTheOneProcessRun) {
  const auto [from, to] = GetParam();
  const int64_t layers = layers_of(from);
  ASSERT_EQ(layers, layers_of(to));
  const Reference ref = reference_run(from.sp, layers, 4);
  testing::TempDir dir("cohort-mesh-reshard");
  run_job({from, 2, dir.str(), false, layers});
  const auto resumed = run_job({to, 4, dir.str(), true, layers});
  for (size_t r = 0; r < resumed.size(); ++r) {
    ASSERT_EQ(resumed[r].metrics.size(), 2u) << "rank " << r;
    for (size_t s = 0; s < 2; ++s) {
      const StepMetrics& m = resumed[r].metrics[s];
      EXPECT_TRUE(close(m.loss, ref.losses[2 + s]))
          << "rank " << r << ", step " << 2 + s << ": " << m.loss << " vs " << ref.losses[2 + s];
      EXPECT_TRUE(close(m.grad_norm, ref.norms[2 + s]))
          << "rank " << r << ", step " << 2 + s << ": " << m.grad_norm << " vs "
          << ref.norms[2 + s];
      EXPECT_EQ(m.samples, kBatch);
    }
  }
}

void PrintTo(const Reshard& r, std::ostream* os) {
  *os << name_of({r.from, 0}) << " to " << name_of({r.to, 0});
}

std::string reshard_name(const ::testing::TestParamInfo<Reshard>& info) {
  return name_of({info.param.from, 0}) + "_to_" + name_of({info.param.to, 0});
}

INSTANTIATE_TEST_SUITE_P(Trainer, MeshTrainerReshard,
                         ::testing::Values(Reshard{{2, 2, 2, false}, {1, 1, 1, false}},
                                           Reshard{{1, 1, 1, false}, {2, 2, 2, false}},
                                           Reshard{{1, 2, 1, false}, {2, 1, 3, false}},
                                           Reshard{{1, 2, 1, false, 2}, {2, 2, 2, false, 2}}),
                         reshard_name);

}  // namespace
}  // namespace cohort::mesh_trainer_test
