// The ranks of one tensor-parallel group must see the same inputs, not only
// the same targets: a column-parallel layer reads its whole input on every
// rank, so inputs augmented per rank make each rank compute its slice of
// another input, and the row-parallel sum adds up mismatched products. A
// data source that changes tokens per rank (the targets the same) is
// refused by fit() on every rank, the replica whose inputs agree included,
// naming the inputs and the ranks; inputs that differ only across pipeline
// ranks (only stage 0 reads them) train (TrainerWiring::mesh on the example
// GPT, ranks as threads).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <mutex>

#include "cohort/core/error.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/thread_ranks.h"

namespace cohort::mesh_data_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kMicro = 2, kRows = 4, kVocab = 8, kSeq = 4;

// Which ranks replace some of their tokens with their own random ones.
enum class Noise { PerRank, OneTpRankOfReplica0, PerPipelineRank };

struct Case {
  int tp, pp, dp;
  Noise noise;
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const char* noise = c.noise == Noise::PerRank               ? "noise_per_rank"
                      : c.noise == Noise::OneTpRankOfReplica0 ? "noise_on_one_tp_rank"
                                                              : "noise_per_pipeline_rank";
  return "tp" + std::to_string(c.tp) + "_pp" + std::to_string(c.pp) + "_dp" + std::to_string(c.dp) +
         "_" + noise;
}

// The data-parallel rank's micro-batches: targets a fixed function of the
// clean tokens, the inputs those tokens with a quarter replaced at random
// from `noise_seed` (none when negative).
class NoisyBatches : public DataSource {
 public:
  NoisyBatches(int dp_rank, int64_t noise_seed) : dp_rank_(dp_rank), noise_seed_(noise_seed) {}
  void set_epoch(int64_t) override {}
  int64_t num_batches() const override { return 2 * kMicro; }
  torch::data::Example<> batch(int64_t index) override {
    auto ids = torch::randint(kVocab, {kRows, kSeq},
                              at::detail::createCPUGenerator(100 + 10 * dp_rank_ + index));
    auto targets = (ids * 5 + 3) % kVocab;
    if (noise_seed_ < 0) return {ids, targets};
    auto gen = at::detail::createCPUGenerator(1000 + noise_seed_ * 10 + index);
    const auto replace = torch::rand({kRows, kSeq}, gen) < 0.25;
    const auto other = torch::randint(kVocab, {kRows, kSeq}, gen);
    return {torch::where(replace, other, ids), targets};
  }

 private:
  int dp_rank_;
  int64_t noise_seed_;
};

class MeshData : public ::testing::TestWithParam<Case> {};

TEST_P(MeshData, EveryRankOfATensorParallelGroupSeesTheSameInputs) {
  const Case c = GetParam();
  const int world = c.tp * c.pp * c.dp;
  std::vector<std::string> errors(world);
  std::vector<int64_t> steps(world, -1);
  std::mutex mu;
  testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(comm, {c.pp, c.dp, c.tp}, {"pp", "dp", "tp"});
    GPTConfig gpt;
    gpt.vocab_size = kVocab;
    gpt.seq_len = kSeq;
    gpt.hidden = 8;
    gpt.heads = 2;
    gpt.layers = 2;
    gpt.seed = 7;
    GPTStage stage(mesh, gpt);
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
                                      stage->shared_embedding_weight());
    auto rt = make_gpt_pipeline(mesh, stage, "1f1b", kMicro);
    torch::optim::SGD opt(rt->parameters(), 0.1);
    TrainerOptions config;
    config.accumulation_steps = kMicro;
    config.progress = false;
    Trainer trainer(TrainerWiring::mesh(mesh, *rt, opt, sync, gpt_tied_parameters()), config);
    const int dp_rank = mesh.local_rank("dp"), tp_rank = mesh.local_rank("tp");
    int64_t seed = -1;
    if (c.noise == Noise::PerRank) seed = comm->rank();
    if (c.noise == Noise::OneTpRankOfReplica0 && dp_rank == 0 && tp_rank == 1) seed = 1;
    if (c.noise == Noise::PerPipelineRank) seed = mesh.local_rank("pp");
    NoisyBatches source(dp_rank, seed);
    try {
      const auto done = trainer.fit(source);
      std::lock_guard<std::mutex> lock(mu);
      steps[comm->rank()] = static_cast<int64_t>(done.size());
    } catch (const InvalidArgument& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors[comm->rank()] = e.what();
    }
  });
  for (int r = 0; r < world; ++r) {
    if (c.noise == Noise::PerPipelineRank) {
      EXPECT_EQ(errors[r], "") << "rank " << r;
      EXPECT_GT(steps[r], 0) << "rank " << r;
      continue;
    }
    EXPECT_EQ(steps[r], -1) << "rank " << r << " trained";
    EXPECT_NE(errors[r].find("inputs"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("tensor-parallel"), std::string::npos) << errors[r];
    // The group whose inputs differ, by its ranks in the world.
    EXPECT_NE(errors[r].find("ranks 0, 1"), std::string::npos) << errors[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, MeshData,
                         ::testing::Values(Case{2, 1, 1, Noise::PerRank},
                                           Case{2, 1, 2, Noise::OneTpRankOfReplica0},
                                           Case{2, 2, 1, Noise::PerPipelineRank}),
                         name_of);

}  // namespace
}  // namespace cohort::mesh_data_test
