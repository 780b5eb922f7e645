// Resuming at another world size (ranks as threads): a job trains at world 4
// to a checkpoint, then resumes at world 1, 2, 3 or 6 with the same global
// batch (12 samples a step: micro-batch x accumulation x world). The next 10
// steps must match the uninterrupted world-4 run within 1e-5 relative, and
// every step must train on the same samples: the epoch's global order
// continues, no sample lost or seen twice. DDP's replicated state, and the
// sharded state of ZeRO-1/2 and FSDP (a distributed checkpoint, resharded on
// load, also into the other of these modes), and the fused optimizer's (a
// distributed checkpoint under LibTorch AdamW's names, so it resumes as DDP
// or FSDP and they as it). And at the same world size with another
// micro-batch and accumulation, against one process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "cohort/dcp/dcp.h"
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/grad_sync/comm_hook.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/trainer_adapters.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::elastic_resume_test {
namespace {

using testing::TempDir;

// 100 samples, 12 a step: 8 steps an epoch, the last 4 samples of each
// epoch's order left out; sizes that neither 4 nor 3 divide.
constexpr int64_t kSamples = 100;
constexpr int64_t kGlobalBatch = 12;

struct Layout {
  int world;
  int64_t micro_batch;
  int64_t accumulation;
};

// How the job trains: DDP and AdamW; DDP and ZeRO stage 1 or 2 over AdamW;
// FSDP (each Linear a unit) and AdamW over the shards; the fused optimizer
// (AdamW over flat buckets, no DDP).
enum class Mode { Ddp, Zero1, Zero2, Fsdp, Fused };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::Ddp:
      return "ddp";
    case Mode::Zero1:
      return "zero1";
    case Mode::Zero2:
      return "zero2";
    case Mode::Fsdp:
      return "fsdp";
    case Mode::Fused:
      return "fused";
  }
  return "?";
}

struct Job {
  Layout layout;
  std::string dir;
  int64_t max_steps;
  bool resume = false;
  Mode mode = Mode::Ddp;
  bool global_order = true;  // false: the source hides its global order
};

// A source without a global sample order (global_micro_batch() 0): the
// same micro-batches, an index that means something to it alone.
class OrderlessSource : public DataSource {
 public:
  explicit OrderlessSource(TensorDataSource& source) : source_(source) {}
  void set_epoch(int64_t epoch) override { source_.set_epoch(epoch); }
  int64_t num_batches() const override { return source_.num_batches(); }
  torch::data::Example<> batch(int64_t index) override { return source_.batch(index); }

 private:
  TensorDataSource& source_;
};

struct JobResult {
  std::optional<int64_t> resumed_at;
  std::map<int64_t, double> loss;                     // step -> loss
  std::map<int64_t, std::multiset<int64_t>> samples;  // step -> samples of all ranks
  std::map<int64_t, int64_t> epoch_of;                // step -> epoch
  std::vector<torch::Tensor> params;                  // rank 0's, at the end
  std::vector<std::string> errors;                    // what resume() threw, by rank
};

// Column 8 of the data is the sample's index: the loss records it and the
// model reads columns 0..7.
torch::Tensor indexed_data() {
  auto data = testing::make_data(kSamples);
  return torch::cat({data.x, torch::arange(kSamples, torch::kFloat32).unsqueeze(1)}, 1);
}

JobResult run_job(const Job& job) {
  const auto data = testing::make_data(kSamples);
  const auto x = indexed_data();
  JobResult result;
  std::mutex mu;
  testing::run_ranks_shared(job.layout.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = testing::make_mlp(job.resume ? 99 : 7);  // resume must overwrite it
    const bool fsdp = job.mode == Mode::Fsdp;
    std::unique_ptr<DistributedDataParallel<torch::nn::Sequential>> ddp;
    FullyShard sharded{nullptr};
    std::function<torch::Tensor(const torch::Tensor&)> forward;
    if (fsdp) {
      torch::nn::Sequential units;
      for (size_t i = 0; i < net->size(); ++i) {
        if (i == 1) {
          units->push_back(torch::nn::Tanh());
          continue;
        }
        torch::nn::Linear linear(net->ptr<torch::nn::LinearImpl>(i));
        units->push_back(FullyShard(torch::nn::AnyModule(linear), comm));
      }
      sharded = fully_shard(units, comm);
      forward = [&](const torch::Tensor& x) { return sharded->forward(x); };
    } else if (job.mode == Mode::Fused) {
      forward = [&](const torch::Tensor& x) { return net->forward(x); };
    } else {
      ddp = std::make_unique<DistributedDataParallel<torch::nn::Sequential>>(net, comm);
      forward = [&](const torch::Tensor& x) { return ddp->forward(x); };
    }
    torch::optim::AdamW opt(fsdp ? sharded->parameters() : net->parameters(),
                            torch::optim::AdamWOptions(1e-2));
    std::unique_ptr<FusedDistributedOptimizer> fused;
    if (job.mode == Mode::Fused) {
      fused = std::make_unique<FusedDistributedOptimizer>(net->parameters(), comm,
                                                          torch::optim::AdamWOptions(1e-2));
    }
    std::unique_ptr<ZeroRedundancyOptimizer> zero;
    if (job.mode == Mode::Zero1 || job.mode == Mode::Zero2) {
      ZeroOptions zo;
      zo.stage = job.mode == Mode::Zero1 ? 1 : 2;
      zo.reduce_gradients = false;  // DDP averages them (stage 2: through ZeRO)
      zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
          *ddp, torch::optim::AdamWOptions(1e-2), zo);
    }
    auto wiring = [&] {
      if (fsdp) return TrainerWiring::fsdp(sharded, opt);
      if (fused) return TrainerWiring::fused(net.ptr(), *fused);
      if (zero) return TrainerWiring::ddp(*ddp, *zero);
      return TrainerWiring::ddp(*ddp, opt);
    };
    TrainerOptions config;
    config.accumulation_steps = job.layout.accumulation;
    config.max_grad_norm = 1.0;
    config.schedule = {LrScheduleKind::WarmupCosine, 1e-2, 3, 30, 1e-4};
    config.epochs = 100;
    config.max_steps = job.max_steps;
    config.checkpoint_dir = job.dir;
    config.progress = false;
    int64_t step = 0;
    Trainer trainer(
        wiring(),
        [&](const torch::data::Example<>& b) {
          {
            std::lock_guard<std::mutex> lock(mu);
            const auto ids = b.data.select(1, 8).to(torch::kInt64).contiguous();
            const int64_t* p = ids.data_ptr<int64_t>();
            for (int64_t i = 0; i < ids.numel(); ++i) result.samples[step + 1].insert(p[i]);
          }
          return torch::nn::functional::cross_entropy(forward(b.data.narrow(1, 0, 8)), b.target);
        },
        config);
    TensorDataSource source(x, data.y, job.layout.micro_batch, comm->rank(), comm->size());
    std::optional<int64_t> resumed;
    std::string error;
    try {
      resumed = job.resume ? trainer.resume() : std::nullopt;
    } catch (const ConfigError& e) {
      error = e.what();  // every rank alike: none trains
    }
    step = trainer.position().step;
    FitCallbacks callbacks;
    callbacks.on_step = [&](const StepMetrics& m) {
      step = m.step;
      if (comm->rank() == 0) {
        result.loss[m.step] = m.loss;
        result.epoch_of[m.step] = m.epoch;
      }
    };
    OrderlessSource orderless(source);
    try {
      if (error.empty())
        trainer.fit(job.global_order ? static_cast<DataSource&>(source) : orderless, callbacks);
    } catch (const ConfigError& e) {
      error = e.what();  // before the first step, on every rank alike
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      result.errors.resize(job.layout.world);
      result.errors[comm->rank()] = error;
    }
    std::vector<torch::Tensor> params;
    if (fsdp) {
      for (const auto& item : sharded->full_state_dict()) params.push_back(item.value());
    } else {
      for (auto& p : net->parameters()) params.push_back(p.detach().clone());
    }
    if (comm->rank() == 0) {
      result.resumed_at = resumed;
      result.params = std::move(params);
    }
  });
  return result;
}

double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>();
}

constexpr Layout kWorld4{4, 3, 1};
constexpr int64_t kResumeAt = 11;  // mid-epoch: step 3 of epoch 1
constexpr int64_t kSteps = 10;

// Trains at `origin` in mode `from`, resumes at `resized` in mode `to`, and
// checks the next kSteps and the samples against the uninterrupted run at
// `reference` (by default the origin's) in `reference_mode` (by default
// `from`).
void expect_resume_continues(Mode from, Mode to, const Layout& resized,
                             const Layout& origin = kWorld4,
                             std::optional<Layout> reference_layout = std::nullopt,
                             std::optional<Mode> reference_mode = std::nullopt) {
  for (const auto& l : {resized, origin, reference_layout.value_or(origin)}) {
    ASSERT_EQ(l.world * l.micro_batch * l.accumulation, kGlobalBatch);
  }
  TempDir whole("cohort-elastic-whole"), split("cohort-elastic-split");
  const auto reference = run_job({reference_layout.value_or(origin), whole.str(),
                                  kResumeAt + kSteps, false, reference_mode.value_or(from)});

  const auto first = run_job({origin, split.str(), kResumeAt, false, from});
  const auto second = run_job({resized, split.str(), kResumeAt + kSteps, /*resume=*/true, to});
  ASSERT_EQ(second.resumed_at, std::optional<int64_t>(kResumeAt));
  ASSERT_EQ(second.loss.size(), static_cast<size_t>(kSteps));

  bool bitwise = true;
  double worst = 0;  // the largest relative difference of a loss or parameter
  for (int64_t s = kResumeAt + 1; s <= kResumeAt + kSteps; ++s) {
    EXPECT_NEAR(second.loss.at(s), reference.loss.at(s), 1e-5 * std::abs(reference.loss.at(s)))
        << "step " << s;
    worst = std::max(
        worst, std::abs(second.loss.at(s) - reference.loss.at(s)) / std::abs(reference.loss.at(s)));
    bitwise = bitwise && second.loss.at(s) == reference.loss.at(s);
    EXPECT_EQ(second.samples.at(s), reference.samples.at(s)) << "samples of step " << s;
  }
  ASSERT_EQ(second.params.size(), reference.params.size());
  for (size_t i = 0; i < reference.params.size(); ++i) {
    const double d = relative_difference(second.params[i], reference.params[i]);
    EXPECT_LE(d, 1e-5) << "parameter " << i;
    worst = std::max(worst, d);
    bitwise = bitwise && torch::equal(second.params[i], reference.params[i]);
  }
  ::testing::Test::RecordProperty("bitwise", bitwise ? "yes" : "no");
  std::printf("%s world %d x %lld -> %s world %d x %lld: %s (largest relative difference %.2g)\n",
              mode_name(from), origin.world, static_cast<long long>(origin.accumulation),
              mode_name(to), resized.world, static_cast<long long>(resized.accumulation),
              bitwise ? "bitwise identical" : "equal within 1e-5, not bitwise", worst);

  // Epoch 1 (steps 9..16) ran partly at world 4, partly at the new size:
  // every sample of its order once, none of the 4 left-out ones.
  std::multiset<int64_t> epoch1;
  for (int64_t s = 9; s <= 16; ++s) {
    const auto& part = s <= kResumeAt ? first.samples.at(s) : second.samples.at(s);
    epoch1.insert(part.begin(), part.end());
  }
  EXPECT_EQ(second.epoch_of.at(16), 1);
  EXPECT_EQ(second.epoch_of.at(17), 2);
  EXPECT_EQ(epoch1.size(), static_cast<size_t>(8 * kGlobalBatch));
  EXPECT_EQ(std::set<int64_t>(epoch1.begin(), epoch1.end()).size(), epoch1.size())
      << "a sample was seen twice in epoch 1";
}

class ElasticResume : public ::testing::TestWithParam<Layout> {};

TEST_P(ElasticResume, NextStepsMatchTheUninterruptedRunOnTheSameSamples) {
  expect_resume_continues(Mode::Ddp, Mode::Ddp, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Trainer, ElasticResume,
                         ::testing::Values(Layout{3, 4, 1}, Layout{2, 3, 2}, Layout{1, 6, 2},
                                           Layout{6, 2, 1}),
                         [](const ::testing::TestParamInfo<Layout>& i) {
                           return "to_world" + std::to_string(i.param.world);
                         });

// The same world size with the global batch cut into other micro-batches
// (micro-batch x accumulation): the checkpoint's micro-batch index counts
// the old ones, so the position must come from the samples done. Checked
// against one process, at world 1 and 2, both ways, DDP and FSDP.
struct Recut {
  Mode mode;
  Layout from, to;
};

class RecutResume : public ::testing::TestWithParam<Recut> {};

TEST_P(RecutResume, NextStepsMatchOneProcessOnTheSameSamples) {
  const Recut r = GetParam();
  expect_resume_continues(r.mode, r.mode, r.to, r.from, Layout{1, kGlobalBatch, 1});
}

INSTANTIATE_TEST_SUITE_P(Trainer, RecutResume,
                         ::testing::Values(Recut{Mode::Ddp, {2, 6, 1}, {2, 3, 2}},
                                           Recut{Mode::Ddp, {2, 3, 2}, {2, 6, 1}},
                                           Recut{Mode::Ddp, {1, 12, 1}, {1, 6, 2}},
                                           Recut{Mode::Ddp, {1, 4, 3}, {1, 6, 2}},
                                           Recut{Mode::Fsdp, {2, 6, 1}, {2, 3, 2}}),
                         [](const ::testing::TestParamInfo<Recut>& i) {
                           const auto& r = i.param;
                           return std::string(mode_name(r.mode)) + "_world" +
                                  std::to_string(r.from.world) + "_accumulation" +
                                  std::to_string(r.from.accumulation) + "_to" +
                                  std::to_string(r.to.accumulation);
                         });

// Sharded state (ZeRO-1/2, FSDP) is a distributed checkpoint: it resumes at
// another world size, also into the other sharded mode, resharded.
struct Resize {
  Mode from, to;
  Layout layout;
};

class ShardedElasticResume : public ::testing::TestWithParam<Resize> {};

TEST_P(ShardedElasticResume, NextStepsMatchTheUninterruptedRunOnTheSameSamples) {
  const Resize r = GetParam();
  expect_resume_continues(r.from, r.to, r.layout);
}

INSTANTIATE_TEST_SUITE_P(Trainer, ShardedElasticResume,
                         ::testing::Values(Resize{Mode::Zero2, Mode::Zero1, {3, 4, 1}},
                                           Resize{Mode::Fsdp, Mode::Fsdp, {2, 3, 2}},
                                           Resize{Mode::Fsdp, Mode::Fsdp, {3, 4, 1}},
                                           Resize{Mode::Zero1, Mode::Zero2, {1, 6, 2}},
                                           Resize{Mode::Zero2, Mode::Fsdp, {2, 3, 2}},
                                           Resize{Mode::Fsdp, Mode::Zero1, {6, 2, 1}}),
                         [](const ::testing::TestParamInfo<Resize>& i) {
                           return std::string(mode_name(i.param.from)) + "_to_" +
                                  mode_name(i.param.to) + "_world" +
                                  std::to_string(i.param.layout.world);
                         });

// A DDP Trainer with a stateful compressor (Int8 with error feedback, per
// rank) on `comm`, checkpointing into `dir` (TrainerOptions's
// checkpoint_every); `use` gets the trainer and the model.
void with_compressed_ddp_trainer(const std::shared_ptr<Communicator>& comm, int seed,
                                 const std::string& dir, int64_t max_steps,
                                 int64_t checkpoint_every,
                                 const std::function<void(Trainer&, torch::nn::Sequential&)>& use) {
  compression::CompressionOptions options;
  options.kind = compression::CompressionKind::Int8;
  auto net = testing::make_mlp(seed);
  DistributedDataParallel<torch::nn::Sequential> ddp(net, comm);
  ddp.register_comm_hook(std::make_shared<CompressionHook>(options));
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
  TrainerOptions config;
  config.checkpoint_dir = dir;
  config.checkpoint_every = checkpoint_every;
  config.max_steps = max_steps;
  config.progress = false;
  Trainer trainer(
      TrainerWiring::ddp(ddp, opt),
      [&](const torch::data::Example<>& b) {
        return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
      },
      config);
  use(trainer, net);
}

// A stateful gradient compressor's error feedback is per rank and cannot be
// resharded: another world size is refused on every rank, naming the
// compressor state, and nothing is loaded (at world 3 every rank finds its
// own entries of the world-4 checkpoint, so only the check stops it).
TEST(ElasticResumeRefused, CompressorStateNamesTheModeAndLoadsNothing) {
  TempDir dir("cohort-elastic-compressor");
  auto train = [&](int world, int64_t max_steps, bool resume, std::vector<std::string>* errors,
                   std::vector<torch::Tensor>* params) {
    const auto data = testing::make_data(kSamples);
    testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      with_compressed_ddp_trainer(comm, resume ? 99 : 7, dir.str(), max_steps, 0,
                                  [&](Trainer& trainer, torch::nn::Sequential& net) {
                                    if (!resume) {
                                      TensorDataSource source(data.x, data.y, 3, comm->rank(),
                                                              comm->size());
                                      trainer.fit(source);
                                      return;
                                    }
                                    try {
                                      trainer.resume();
                                    } catch (const ConfigError& e) {
                                      (*errors)[comm->rank()] = e.what();
                                    }
                                    (*params)[comm->rank()] = net->parameters()[0].detach().clone();
                                  });
    });
  };
  train(4, 4, false, nullptr, nullptr);
  std::vector<std::string> errors(3);
  std::vector<torch::Tensor> params(3);
  train(3, 4, true, &errors, &params);
  const auto fresh = testing::make_mlp(99)->parameters()[0];
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("written by 4 ranks, this job has 3"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("compressor"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("cannot be resharded: resume at 4 ranks"), std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("on rank " + std::to_string(r)), std::string::npos) << errors[r];
    EXPECT_TRUE(torch::equal(params[r], fresh)) << "rank " << r << " loaded the model";
  }
}

// Every wiring writes a distributed checkpoint, so a Trainer checkpoint
// resumes in another mode at another world size: DDP at world 2 as FSDP at
// world 3, FSDP at world 4 as DDP at world 1, each continuing one process's
// run within 1e-5 on the same samples.
TEST(CrossModeResume, DdpToFsdpAndFsdpToDdpContinueOneProcess) {
  const Layout one_process{1, kGlobalBatch, 1};
  expect_resume_continues(Mode::Ddp, Mode::Fsdp, {3, 4, 1}, {2, 6, 1}, one_process);
  expect_resume_continues(Mode::Fsdp, Mode::Ddp, one_process, {4, 3, 1}, one_process);
}

// The fused optimizer's checkpoint holds its AdamW state under LibTorch
// AdamW's names: fused at world 2 resumes as DDP + AdamW at world 3 and as
// FSDP at world 3, and DDP at world 2 as fused at world 3, each continuing
// one process's DDP + AdamW run within 1e-5 on the same samples.
TEST(CrossModeResume, FusedToDdpContinuesOneProcess) {
  const Layout one_process{1, kGlobalBatch, 1};
  expect_resume_continues(Mode::Fused, Mode::Ddp, {3, 4, 1}, {2, 6, 1}, one_process, Mode::Ddp);
}

TEST(CrossModeResume, FusedToFsdpContinuesOneProcess) {
  const Layout one_process{1, kGlobalBatch, 1};
  expect_resume_continues(Mode::Fused, Mode::Fsdp, {3, 4, 1}, {2, 6, 1}, one_process, Mode::Ddp);
}

TEST(CrossModeResume, DdpToFusedContinuesOneProcess) {
  const Layout one_process{1, kGlobalBatch, 1};
  expect_resume_continues(Mode::Ddp, Mode::Fused, {3, 4, 1}, {2, 6, 1}, one_process, Mode::Ddp);
}

// A source without a global order keeps the checkpoint's micro-batch index:
// right for another accumulation with the same micro-batches, but with
// micro-batches of another size it would train on other samples, so that is
// a ConfigError on every rank naming both counts, before any step.
TEST(ElasticResumeRefused, SourceWithoutGlobalOrderRefusesMicroBatchesOfAnotherSize) {
  TempDir dir("cohort-elastic-orderless");
  run_job({{2, 6, 1}, dir.str(), kResumeAt, false, Mode::Ddp, false});
  const auto refused = run_job({{2, 3, 2}, dir.str(), kResumeAt + 2, true, Mode::Ddp, false});
  ASSERT_EQ(refused.errors.size(), 2u);
  for (const auto& e : refused.errors) {
    EXPECT_NE(e.find("16 micro-batches an epoch, the job that wrote the checkpoint had 8"),
              std::string::npos)
        << e;
  }
  EXPECT_TRUE(refused.loss.empty());
  const auto same = run_job({{2, 6, 1}, dir.str(), kResumeAt + 2, true, Mode::Ddp, false});
  EXPECT_EQ(same.errors, std::vector<std::string>(2));
  EXPECT_EQ(same.loss.size(), 2u);
}

// A stateful compressor's state of rank 1 damaged in the newest
// checkpoint's dcp folder, which only rank 1 reads: every rank falls back to
// the previous checkpoint alike, and says which file and why.
TEST(SyncStateFallback, DamagedCompressorStateFallsBackOnEveryRank) {
  TempDir dir("cohort-sync-fallback");
  const auto data = testing::make_data(kSamples);
  std::vector<std::optional<int64_t>> resumed(2);
  std::vector<std::string> skipped(2);
  auto train = [&](bool resume) {
    testing::run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
      with_compressed_ddp_trainer(
          comm, resume ? 99 : 7, dir.str(), 4, 2, [&](Trainer& trainer, torch::nn::Sequential&) {
            if (!resume) {
              TensorDataSource source(data.x, data.y, 3, comm->rank(), comm->size());
              trainer.fit(source);
              return;
            }
            resumed[comm->rank()] = trainer.resume();
            if (!trainer.skipped_checkpoints().empty()) {
              skipped[comm->rank()] = trainer.skipped_checkpoints().front();
            }
          });
    });
  };
  train(false);
  const std::string folder = CheckpointDir(dir.str(), 3).path_for(4) + ".dcp";
  const auto meta = dcp::read_metadata(folder);
  const dcp::ChunkMeta* chunk = nullptr;
  for (const auto& t : meta.tensors) {
    if (t.fqn.rfind("sync.rank1.", 0) == 0 && !t.chunks.empty()) chunk = &t.chunks.front();
  }
  ASSERT_NE(chunk, nullptr) << "rank 1's compressor state is not in " << folder;
  ASSERT_EQ(chunk->file, 1);
  const std::string file = folder + "/" + dcp::data_file_name(1);
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GT(bytes.size(), static_cast<size_t>(chunk->byte_offset));
  bytes[chunk->byte_offset] ^= 0x40;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  train(true);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(resumed[r], std::optional<int64_t>(2)) << "rank " << r;
    EXPECT_NE(skipped[r].find(file), std::string::npos) << skipped[r];
    EXPECT_NE(skipped[r].find("checksum mismatch in tensor sync.rank1."), std::string::npos)
        << skipped[r];
  }
}

// A DDP trainer with a stateful compressor writes its per-rank state into
// the distributed checkpoint; a trainer without such a compressor (FSDP,
// ZeRO) does not resume it: a ConfigError on every rank naming the
// compressor state and its own mode, at the same world size and at another,
// with nothing loaded.
TEST(ElasticResumeRefused, CompressorCheckpointIntoFsdpOrZeroNamesBothAndLoadsNothing) {
  TempDir dir("cohort-elastic-ddp");
  const auto data = testing::make_data(kSamples);
  testing::run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    with_compressed_ddp_trainer(
        comm, 7, dir.str(), 4, 0, [&](Trainer& trainer, torch::nn::Sequential&) {
          TensorDataSource source(data.x, data.y, 3, comm->rank(), comm->size());
          trainer.fit(source);
        });
  });
  const auto fresh = testing::make_mlp(99)->parameters();
  struct Into {
    Mode mode;
    Layout layout;
    const char* names;
  };
  for (const auto& into : {Into{Mode::Fsdp, {2, 6, 1}, "FSDP"}, Into{Mode::Fsdp, {3, 4, 1}, "FSDP"},
                           Into{Mode::Zero1, {2, 6, 1}, "ZeRO"}}) {
    const auto r = run_job({into.layout, dir.str(), 8, /*resume=*/true, into.mode});
    ASSERT_EQ(r.errors.size(), static_cast<size_t>(into.layout.world));
    for (const auto& e : r.errors) {
      EXPECT_NE(e.find("state of a stateful gradient compressor"), std::string::npos) << e;
      EXPECT_NE(e.find(into.names), std::string::npos) << e;
      EXPECT_NE(e.find("resume with the compressor that wrote it"), std::string::npos) << e;
    }
    EXPECT_TRUE(r.loss.empty());
    ASSERT_EQ(r.params.size(), fresh.size());
    for (size_t i = 0; i < fresh.size(); ++i) {
      EXPECT_TRUE(torch::equal(r.params[i], fresh[i])) << mode_name(into.mode) << " loaded " << i;
    }
  }
}

}  // namespace
}  // namespace cohort::elastic_resume_test
