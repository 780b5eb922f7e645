// A resume whose global batch (micro-batch x accumulation x data-parallel
// size) differs from the checkpoint's is refused on every rank before any
// step: it would cut each epoch into another number of steps than the
// checkpoint's step count assumes, so fit() could end before an epoch it
// never trained. The same global batch at another world size resumes; a
// checkpoint without the record (an older cohort's) keeps the old checks.
#include <gtest/gtest.h>
#include <torch/serialize/archive.h>

#include <mutex>
#include <sstream>

#include "cohort/core/error.h"
#include "cohort/train/rng_state.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::resume_batch_test {
namespace {

using testing::TempDir;

constexpr int64_t kSamples = 64;

struct Job {
  int world;
  int64_t micro_batch;
  int64_t max_steps;  // 0: to the end of the epochs
  bool resume;
};

struct Outcome {
  std::vector<std::string> errors;  // per rank, empty when none
  int64_t steps = 0;                // rank 0's steps run by fit()
  int64_t final_step = 0;
  int64_t final_epoch = 0;
};

Outcome run(const std::string& backend, const std::string& dir, const Job& job) {
  const auto data = testing::make_data(kSamples);
  Outcome out;
  out.errors.resize(job.world);
  std::mutex mu;
  testing::ThreadRanksOptions options;
  options.backend = backend;
  testing::run_ranks_shared(
      job.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto net = testing::make_mlp();
        torch::optim::SGD opt(net->parameters(), 0.05);
        TrainerOptions config;
        config.epochs = 2;
        config.max_steps = job.max_steps;
        config.checkpoint_dir = dir;
        config.progress = false;
        Trainer trainer(
            TrainerWiring::all_reduce(net.ptr(), opt, comm),
            [&](const torch::data::Example<>& b) {
              return torch::nn::functional::cross_entropy(net->forward(b.data), b.target);
            },
            config);
        TensorDataSource source(data.x, data.y, job.micro_batch, comm->rank(), comm->size());
        try {
          if (job.resume) trainer.resume();
          const auto steps = trainer.fit(source);
          std::lock_guard<std::mutex> lock(mu);
          if (comm->rank() == 0) {
            out.steps = static_cast<int64_t>(steps.size());
            out.final_step = trainer.position().step;
            out.final_epoch = trainer.position().epoch;
          }
        } catch (const ConfigError& e) {
          std::lock_guard<std::mutex> lock(mu);
          out.errors[comm->rank()] = e.what();
        }
      },
      options);
  return out;
}

// The resumed job's engine and world size.
using Case = cohort::testing::EngineWorld;

std::vector<Case> cases() { return cohort::testing::engine_worlds({1, 2, 3}); }

class ResumeGlobalBatch : public ::testing::TestWithParam<Case> {};

// World 1, micro-batch 4: 16 steps an epoch; the checkpoint is at the end
// of epoch 0 (step 16). Resumed at world w with micro-batch 4 a rank (a
// global batch of 4w): refused for w > 1, where it would have run no step.
TEST_P(ResumeGlobalBatch, AnotherGlobalBatchIsRefusedOnEveryRank) {
  const Case c = GetParam();
  TempDir dir("cohort-resume-batch");
  const auto first = run(c.backend, dir.str(), {1, 4, 16, false});
  ASSERT_EQ(first.errors, std::vector<std::string>(1));
  ASSERT_EQ(first.final_step, 16);
  ASSERT_EQ(first.final_epoch, 1);
  const auto resumed = run(c.backend, dir.str(), {c.world, 4, 0, true});
  if (c.world == 1) {
    EXPECT_EQ(resumed.errors, std::vector<std::string>(1));
    EXPECT_EQ(resumed.steps, 16) << "epoch 1 trains";
    return;
  }
  for (const auto& e : resumed.errors) {
    EXPECT_NE(e.find("global batch is 4 samples, but this job's is " + std::to_string(4 * c.world)),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("micro-batch x accumulation_steps x data-parallel size"), std::string::npos)
        << e;
  }
  // The same global batch at world 2 (micro-batch 2) trains epoch 1.
  const auto same = run(c.backend, dir.str(), {2, 2, 0, true});
  EXPECT_EQ(same.errors, std::vector<std::string>(2));
  EXPECT_EQ(same.steps, 16);
  EXPECT_EQ(same.final_epoch, 2);
}

INSTANTIATE_TEST_SUITE_P(Trainer, ResumeGlobalBatch, ::testing::ValuesIn(cases()),
                         cohort::testing::engine_world_name);

// The record round-trips; a checkpoint written before it (no global_batch
// in its payload) decodes as unknown (0).
TEST(ResumeGlobalBatchRecord, RoundTripsAndOldPayloadIsUnknown) {
  TrainingPosition p;
  p.step = 16, p.epoch = 1, p.batch = 0, p.epoch_samples = 0, p.epoch_batches = 16;
  p.global_batch = 4;
  const auto rng = torch::zeros({1, 8}, torch::kUInt8);
  const auto decoded = decode_training_state(encode_training_state(p, rng), "new");
  EXPECT_EQ(decoded.position.global_batch, 4);
  EXPECT_EQ(decoded.position.step, 16);

  torch::serialize::OutputArchive old;
  old.write("step", c10::IValue(int64_t{16}));
  old.write("epoch", c10::IValue(int64_t{1}));
  old.write("batch", c10::IValue(int64_t{0}));
  old.write("epoch_samples", c10::IValue(int64_t{0}));
  old.write("epoch_batches", c10::IValue(int64_t{16}));
  old.write("rng_states", rng);
  old.write("dcp", c10::IValue(true));
  std::ostringstream bytes;
  old.save_to(bytes);
  const auto legacy = decode_training_state(bytes.str(), "old");
  EXPECT_EQ(legacy.position.global_batch, 0);
  EXPECT_EQ(legacy.position.epoch_batches, 16);
}

// The accelerator generators' states: recorded when given, absent from a
// CPU job's checkpoint and from one written before they were recorded.
TEST(ResumeGlobalBatchRecord, DeviceRngStatesRoundTrip) {
  TrainingPosition p;
  const auto rng = torch::zeros({2, 8}, torch::kUInt8);
  const auto device_rng = torch::arange(32, torch::kInt64).to(torch::kUInt8).view({2, 16});
  const auto with = decode_training_state(encode_training_state(p, rng, {}, device_rng), "gpu");
  ASSERT_TRUE(with.device_rng_states.defined());
  EXPECT_TRUE(torch::equal(with.device_rng_states, device_rng));
  const auto without = decode_training_state(encode_training_state(p, rng), "cpu");
  EXPECT_FALSE(without.device_rng_states.defined());
}

// device_rng_state goes through at::Context as for a CUDA device: on the
// CPU it is the CPU generator's state, and restoring it repeats the draws.
TEST(ResumeGlobalBatchRecord, DeviceRngStateRestoresTheStream) {
  const torch::Device cpu(torch::kCPU);
  seed_device_rng(cpu, 5);
  const auto state = device_rng_state(cpu);
  EXPECT_TRUE(torch::equal(state, cpu_rng_state()));
  const auto first = torch::rand({4});
  set_device_rng_state(cpu, state);
  EXPECT_TRUE(torch::equal(torch::rand({4}), first));
  seed_device_rng(cpu, 6);
  EXPECT_FALSE(torch::equal(torch::rand({4}), first));
}

}  // namespace
}  // namespace cohort::resume_batch_test
