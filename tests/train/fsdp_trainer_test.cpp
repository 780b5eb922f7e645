// The Trainer stepping a fully sharded model (ranks as threads, world 1 to
// 3, and HSDP at 2 x 2 and 3 x 2): with accumulation and clipping by the
// global norm over the shards it takes the same steps as one process on the
// whole global batch (within 1e-6 relative; the reported loss is the global
// batch's), reduce-scatters once per unit per step whatever the
// number of micro-batches, and a run stopped and resumed from its
// distributed checkpoint is bitwise the uninterrupted one (every shard, buffer and
// optimizer state), also when an evaluation forward left the root's own
// parameters gathered before a checkpoint.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <optional>

#include "cohort/core/torch_compat.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"

namespace cohort::fsdp_trainer_test {
namespace {

using torch::nn::AnyModule;

constexpr int64_t kIn = 6, kMicro = 2, kSteps = 6;
constexpr double kMaxNorm = 0.05;
constexpr int kUnits = 3;  // the Linear units, and the root's own Linear(5, 1)

enum class Opt { AdamW, SGD };

struct Case {
  int world;
  int64_t accumulation;
  Opt opt;
  bool reshard_after_forward;
  int replicate = 1;  // HSDP's replica groups (world / replicate ranks shard each unit)
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "world" + std::to_string(c.world) + "_k" + std::to_string(c.accumulation) +
         (c.opt == Opt::AdamW ? "_adamw" : "_sgd") + (c.reshard_after_forward ? "" : "_keep") +
         (c.replicate > 1 ? "_hsdp" + std::to_string(c.replicate) : "");
}

// Case c's mesh over the world: 1-D, or HSDP's replicate x shard.
DeviceMesh mesh_of(const Case& c, const std::shared_ptr<Communicator>& world) {
  if (c.replicate == 1) return DeviceMesh::from_group(world, "shard");
  return init_device_mesh(world, {c.replicate, c.world / c.replicate}, {"replicate", "shard"});
}

double lr_of(Opt opt) { return opt == Opt::AdamW ? 1e-2 : 0.05; }

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt opt,
                                                        std::vector<torch::Tensor> params) {
  if (opt == Opt::AdamW) {
    return std::make_unique<torch::optim::AdamW>(
        std::move(params), torch::optim::AdamWOptions(lr_of(opt)).weight_decay(0.1));
  }
  return std::make_unique<torch::optim::SGD>(std::move(params),
                                             torch::optim::SGDOptions(lr_of(opt)).momentum(0.9));
}

// Linear(6, 7) Tanh [BatchNorm1d(7)] Linear(7, 5) Tanh Linear(5, 1): 7 and 5
// rows do not divide by 2 or 3, and the last layer's single row leaves the
// other ranks an empty shard. With `comm` the first two Linears (and the
// BatchNorm) are units and the last Linear is the root's own; `phase`
// shifts every value (a resumed run must overwrite them).
torch::nn::Sequential make_model(const std::optional<DeviceMesh>& mesh, bool batch_norm,
                                 bool reshard_after_forward = true, double phase = 0) {
  torch::nn::Linear a(kIn, 7), b(7, 5), c(5, 1);
  torch::nn::BatchNorm1d bn(7);
  {
    torch::NoGradGuard no_grad;
    double k = phase;
    for (auto* m : std::vector<torch::nn::Module*>{a.get(), b.get(), c.get(), bn.get()}) {
      for (auto& p : m->parameters()) {
        const auto n = p.numel();
        p.copy_((torch::sin(torch::arange(n, torch::kFloat32) * 0.37 + k) * 0.5).view_as(p));
        k += 1;
      }
    }
  }
  FullyShardOptions options;
  options.reshard_after_forward = reshard_after_forward;
  auto unit = [&](AnyModule m) { return mesh ? AnyModule(FullyShard(m, *mesh, options)) : m; };
  torch::nn::Sequential seq;
  seq->push_back(unit(AnyModule(a)));
  seq->push_back(torch::nn::Tanh());
  if (batch_norm) seq->push_back(unit(AnyModule(bn)));
  seq->push_back(unit(AnyModule(b)));
  seq->push_back(torch::nn::Tanh());
  seq->push_back(c);
  return seq;
}

struct Data {
  torch::Tensor x, y;
};

Data make_data(int64_t n) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  return {torch::randn({n, kIn}, gen), torch::randn({n, 1}, gen)};
}

int64_t global_batch(const Case& c) { return c.world * c.accumulation * kMicro; }

// Rank r's micro-batch i of step s: a contiguous slice of step s's global batch.
class RankSource : public DataSource {
 public:
  RankSource(Data data, const Case& c, int rank) : data_(std::move(data)), c_(c), rank_(rank) {}
  void set_epoch(int64_t) override {}
  int64_t num_batches() const override { return kSteps * c_.accumulation; }
  torch::data::Example<> batch(int64_t index) override {
    const int64_t step = index / c_.accumulation, i = index % c_.accumulation;
    const int64_t start = step * global_batch(c_) + (rank_ * c_.accumulation + i) * kMicro;
    return {data_.x.narrow(0, start, kMicro), data_.y.narrow(0, start, kMicro)};
  }

 private:
  Data data_;
  Case c_;
  int rank_;
};

using Named = std::map<std::string, torch::Tensor>;

struct Reference {
  Named params;
  std::vector<double> norms, losses;
};

// One process, the whole global batch per step, clip_grad_norm_.
Reference reference_run(const Case& c, const Data& data) {
  auto model = make_model(std::nullopt, false);
  auto opt = make_optimizer(c.opt, model->parameters());
  Reference ref;
  const int64_t global = global_batch(c);
  for (int64_t s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    auto loss = torch::mse_loss(model->forward(data.x.narrow(0, s * global, global)),
                                data.y.narrow(0, s * global, global));
    ref.losses.push_back(loss.item<double>());
    loss.backward();
    ref.norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxNorm));
    opt->step();
  }
  for (const auto& p : model->named_parameters()) ref.params[p.key()] = p.value().detach().clone();
  return ref;
}

TrainerOptions make_config(const Case& c) {
  TrainerOptions config;
  config.accumulation_steps = c.accumulation;
  config.max_grad_norm = kMaxNorm;
  config.schedule.base_lr = lr_of(c.opt);
  config.progress = false;
  return config;
}

class FsdpTrainer : public ::testing::TestWithParam<Case> {};

TEST_P(FsdpTrainer, MatchesOneProcessOnTheGlobalBatchWithClipping) {
  const Case c = GetParam();
  const auto data = make_data(kSteps * global_batch(c));
  const auto ref = reference_run(c, data);
  std::mutex mu;
  std::map<int, torch::OrderedDict<std::string, torch::Tensor>> got;
  testing::run_ranks_shared(c.world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    FullyShardOptions options;
    options.reshard_after_forward = c.reshard_after_forward;
    const auto mesh = mesh_of(c, comm);
    auto model = fully_shard(make_model(mesh, false, c.reshard_after_forward), mesh, options);
    auto opt = make_optimizer(c.opt, model->parameters());
    LossFn loss = [&](const torch::data::Example<>& b) {
      return torch::mse_loss(model->forward(b.data), b.target);
    };
    Trainer trainer(TrainerWiring::fsdp(model, *opt), loss, make_config(c));
    RankSource source(data, c, comm->rank());
    for (int64_t s = 0; s < kSteps; ++s) {
      std::vector<torch::data::Example<>> batches;
      for (int64_t i = 0; i < c.accumulation; ++i) {
        batches.push_back(source.batch(s * c.accumulation + i));
      }
      // The shard group's own count (under HSDP a subgroup of the world).
      const auto& shard_group = *model->process_group();
      const auto before = shard_group.stats();
      const auto m = trainer.train_step(batches);
      const auto during = shard_group.stats().since(before);
      const double expected = ref.norms[static_cast<size_t>(s)];
      EXPECT_NEAR(m.grad_norm, expected, 1e-5 * expected) << "step " << s;
      const double loss = ref.losses[static_cast<size_t>(s)];
      EXPECT_NEAR(m.loss, loss, 1e-5 * loss) << "step " << s << " on rank " << comm->rank();
      EXPECT_TRUE(m.clipped) << "the test must exercise clipping";
      EXPECT_EQ(m.samples, global_batch(c));
      // Accumulation keeps the non-final micro-batches local: one
      // reduce-scatter per unit per step.
      EXPECT_EQ(during[OpKind::ReduceScatterTensor].calls, static_cast<uint64_t>(kUnits))
          << "step " << s << " on rank " << comm->rank();
      if (c.world > 1) {
        EXPECT_GT(m.comm_seconds, 0.0);
      }
    }
    auto state = model->full_state_dict();
    std::lock_guard<std::mutex> lock(mu);
    got[comm->rank()] = state;
  });
  ASSERT_EQ(got.size(), static_cast<size_t>(c.world));
  for (const auto& [rank, state] : got) {
    ASSERT_EQ(state.size(), ref.params.size());
    for (const auto& [name, expected] : ref.params) {
      const auto* g = state.find(name);
      ASSERT_NE(g, nullptr) << name;
      const double scale = expected.abs().max().item<double>();
      const double err = (*g - expected).abs().max().item<double>();
      EXPECT_LE(err, 1e-6 * scale)
          << name << " on rank " << rank << " differs by " << err / scale << " relative";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Trainer, FsdpTrainer,
    ::testing::Values(Case{1, 1, Opt::AdamW, true}, Case{2, 1, Opt::AdamW, true},
                      Case{3, 1, Opt::AdamW, true}, Case{2, 2, Opt::SGD, true},
                      Case{3, 2, Opt::AdamW, false}, Case{1, 3, Opt::SGD, false},
                      Case{4, 1, Opt::AdamW, true, 2}, Case{6, 2, Opt::SGD, false, 3}),
    name_of);

// What one rank holds after a run: its shards, buffers and AdamW state.
struct RankState {
  std::vector<torch::Tensor> tensors;
  std::vector<std::string> names;
};

struct Job {
  Case c;
  std::string dir;
  int64_t max_steps = kSteps;
  bool resume = false;
  bool async = false;  // TrainerOptions::async_checkpoint
};

RankState run_rank(const Job& job, const std::shared_ptr<Communicator>& comm, const Data& data) {
  torch::set_num_threads(1);
  const Case& c = job.c;
  FullyShardOptions options;
  options.reshard_after_forward = c.reshard_after_forward;
  const auto mesh = mesh_of(c, comm);
  auto model = fully_shard(make_model(mesh, true, c.reshard_after_forward, job.resume ? 0.5 : 0),
                           mesh, options);
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(lr_of(Opt::AdamW)).weight_decay(0.1));
  auto config = make_config(c);
  config.max_steps = job.max_steps;
  config.checkpoint_dir = job.dir;
  config.checkpoint_every = 2;
  config.async_checkpoint = job.async;
  LossFn loss = [&](const torch::data::Example<>& b) {
    return torch::mse_loss(model->forward(b.data), b.target);
  };
  Trainer trainer(TrainerWiring::fsdp(model, opt), loss, config);
  if (job.resume) {
    EXPECT_EQ(trainer.resume(), std::optional<int64_t>(3));
  }
  RankSource source(data, c, comm->rank());
  // An evaluation forward after every step leaves the root's own
  // parameters gathered: the checkpoint must still hold the shards.
  FitCallbacks callbacks;
  callbacks.on_step = [&](const StepMetrics&) {
    torch::NoGradGuard no_grad;
    model->eval();
    model->forward(source.batch(0).data);
    model->train();
  };
  trainer.fit(source, callbacks);
  RankState out;
  for (const auto& p : model->named_parameters()) {
    out.names.push_back(p.key());
    out.tensors.push_back(p.value().detach().clone());
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(
        *opt.state().at(cohort::optimizer_state_key(p.value())));
    out.names.push_back(p.key() + ".exp_avg");
    out.tensors.push_back(st.exp_avg().clone());
    out.names.push_back(p.key() + ".exp_avg_sq");
    out.tensors.push_back(st.exp_avg_sq().clone());
    out.names.push_back(p.key() + ".step");
    out.tensors.push_back(torch::tensor({st.step()}, torch::kInt64));
  }
  for (const auto& b : model->named_buffers()) {
    out.names.push_back(b.key());
    out.tensors.push_back(b.value().clone());
  }
  return out;
}

std::vector<RankState> run_job(const Job& job, const Data& data) {
  std::vector<RankState> out(static_cast<size_t>(job.c.world));
  std::mutex mu;
  testing::run_ranks_shared(job.c.world, [&](std::shared_ptr<Communicator> comm) {
    auto state = run_rank(job, comm, data);
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(comm->rank())] = std::move(state);
  });
  return out;
}

void expect_same_states(const std::vector<RankState>& resumed,
                        const std::vector<RankState>& expected, const std::string& what) {
  ASSERT_EQ(resumed.size(), expected.size());
  for (size_t r = 0; r < expected.size(); ++r) {
    const auto& want = expected[r];
    const auto& got = resumed[r];
    ASSERT_EQ(got.names, want.names);
    for (size_t i = 0; i < want.tensors.size(); ++i) {
      EXPECT_TRUE(torch::equal(got.tensors[i], want.tensors[i]))
          << want.names[i] << " on rank " << r << " differs after " << what;
    }
  }
}

class FsdpTrainerResume : public ::testing::TestWithParam<Case> {};

TEST_P(FsdpTrainerResume, StopAndResumeIsBitwiseTheUninterruptedRun) {
  const Case c = GetParam();
  const auto data = make_data(kSteps * global_batch(c));
  testing::TempDir straight("fsdp_straight"), broken("fsdp_broken");
  const auto expected = run_job({c, straight.path()}, data);
  run_job({c, broken.path(), /*max_steps=*/3}, data);
  // Each rank wrote its data file into the distributed checkpoint next to
  // rank 0's file.
  const auto folder = std::filesystem::path(broken.path()) / "ckpt-0000000003.cohort.dcp";
  EXPECT_TRUE(std::filesystem::exists(folder / ".metadata"));
  for (int r = 0; r < c.world; ++r) {
    const auto file = "__" + std::to_string(r) + "_0.distcp";
    EXPECT_TRUE(std::filesystem::exists(folder / file)) << file;
  }
  const auto resumed = run_job({c, broken.path(), kSteps, /*resume=*/true}, data);
  expect_same_states(resumed, expected, "resume");
}

// With async_checkpoint the saves are committed at the next save or at the
// end of fit(): the stopped run's last checkpoint is whole, and resuming
// from it is the uninterrupted (blocking-save) run, bit for bit.
TEST_P(FsdpTrainerResume, AsyncCheckpointsResumeLikeBlockingOnes) {
  const Case c = GetParam();
  const auto data = make_data(kSteps * global_batch(c));
  testing::TempDir straight("fsdp_straight"), broken("fsdp_async");
  const auto expected = run_job({c, straight.path()}, data);
  run_job({c, broken.path(), /*max_steps=*/3, /*resume=*/false, /*async=*/true}, data);
  const auto dir = std::filesystem::path(broken.path());
  EXPECT_TRUE(std::filesystem::exists(dir / "ckpt-0000000003.cohort"));
  EXPECT_TRUE(std::filesystem::exists(dir / "ckpt-0000000003.cohort.dcp" / ".metadata"));
  EXPECT_TRUE(std::filesystem::exists(dir / "ckpt-0000000002.cohort.dcp" / ".metadata"));
  const auto resumed = run_job({c, broken.path(), kSteps, /*resume=*/true, /*async=*/true}, data);
  expect_same_states(resumed, expected, "an async resume");
}

INSTANTIATE_TEST_SUITE_P(Trainer, FsdpTrainerResume,
                         ::testing::Values(Case{1, 1, Opt::AdamW, true},
                                           Case{2, 2, Opt::AdamW, true},
                                           Case{3, 1, Opt::AdamW, false},
                                           Case{4, 1, Opt::AdamW, true, 2}),
                         name_of);

TEST(FsdpTrainerWiring, AnOptimizerOverOtherTensorsIsRefusedOnEveryRank) {
  testing::run_ranks_shared(2, [](std::shared_ptr<Communicator> comm) {
    const auto mesh = DeviceMesh::from_group(comm, "shard");
    auto model = fully_shard(make_model(mesh, false), mesh);
    auto other = make_model(std::nullopt, false);
    torch::optim::SGD opt(other->parameters(), 0.1);
    try {
      TrainerWiring::fsdp(model, opt);
      ADD_FAILURE() << "no error on rank " << comm->rank();
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("not a parameter of the fully sharded model"),
                std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
}  // namespace cohort::fsdp_trainer_test
