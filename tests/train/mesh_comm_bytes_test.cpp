// The bytes a mesh Trainer reports per dimension under context and expert
// parallelism (TrainerWiring::mesh on the example GPT, ranks as threads,
// pp 1 x dp x ep x cp x tp 1), against closed forms of what each rank sends:
//
// "cp", ring attention over the cp group (cohort/context_parallel): per
// micro-batch and layer, one all-gather of 7 int64 words (the inputs'
// agreement, (c - 1) * 56 bytes), c - 1 K/V blocks in forward, c - 1 K/V
// blocks and c dK/dV blocks in backward, each block [2, b, H, S/c, D]
// float32; per micro-batch the sequence loss's all-reduce of 2 + c doubles
// (a ring: floor(2 (c - 1) n / c) bytes of n) and, with experts, each MoE
// layer's load-balancing statistics, an all-reduce of 2 E + 2 + 2 c doubles.
// Nothing at c = 1.
//
// "dp", the gradients' average over the dense group dp x ep x cp
// (Megatron-LM's data-parallel group under context parallelism), once per
// step: the one bucket of all P float32 non-expert gradients and the one
// all-reduce of those N parameters' presence flags with a failure word per
// rank (N + d int32: a replica's failed step rides it), each
// floor(2 (d - 1) n / d) bytes at d = dp * ep * cp; with experts, the same
// two all-reduces of the expert parameters over dp x cp (no failure words).
// Nothing over a group of one rank.
//
// "ep", the experts' all-to-all, depends on the routing: above 0 at ep 2.
// The step's comm_bytes is the sum of the dimensions: at tp 1 and pp 1
// nothing else moves.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <map>
#include <mutex>
#include <set>

#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/thread_ranks.h"

namespace cohort::mesh_comm_bytes_test {
namespace {

using namespace cohort::tensor_parallel;

// kSeq splits into 2 c equal chunks at c = 1, 2, 3.
constexpr int64_t kSamples = 48, kRows = 2, kMicro = 2, kSteps = 2, kVocab = 8, kSeq = 12;
constexpr int64_t kHidden = 8, kHeads = 2, kLayers = 2;

struct Case {
  int dp, cp, ep = 1;
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "dp" + std::to_string(c.dp) + "_cp" + std::to_string(c.cp) + "_ep" + std::to_string(c.ep);
}

GPTConfig config(int ep) {
  GPTConfig c;
  if (ep > 1) c.experts = 2 * ep;  // a MoE feed-forward in block 1
  c.vocab_size = kVocab;
  c.seq_len = kSeq;
  c.hidden = kHidden;
  c.heads = kHeads;
  c.layers = kLayers;
  c.seed = 7;
  return c;
}

// Ring allreduce's bytes sent per rank for n bytes at p ranks
// (cohort/observability/comm_stats.h).
int64_t ring_all_reduce(int64_t n, int64_t p) { return p == 1 ? 0 : 2 * (p - 1) * n / p; }

int64_t expected_cp_bytes(int64_t c, int ep) {
  if (c == 1) return 0;
  const int64_t experts = config(ep).experts, moe_layers = experts > 0 ? kLayers / 2 : 0;
  // Per expert two sums, the tokens, the assignments, and per rank a refusal
  // word and the backward flags (routing.cpp, expert_parallel/README.md).
  const int64_t balance = moe_layers * ring_all_reduce((2 * experts + 2 + 2 * c) * 8, c);
  const int64_t block = 2 * kRows * kHeads * (kSeq / c) * (kHidden / kHeads) * 4;
  const int64_t agreement = (c - 1) * 7 * 8;
  const int64_t ring = (c - 1) * block + (c - 1) * block + c * block;
  const int64_t loss = ring_all_reduce((2 + c) * 8, c);
  return kMicro * (kLayers * (agreement + ring) + loss + balance);
}

// The elements and tensors of a group of parameters.
struct Count {
  int64_t numel = 0, tensors = 0;
};

// The two all-reduces (gradients, presence flags and `words` more) of `p` over `ranks`.
int64_t average_bytes(const Count& p, int64_t ranks, int64_t words = 0) {
  return ring_all_reduce(p.numel * 4, ranks) + ring_all_reduce((p.tensors + words) * 4, ranks);
}

struct Job {
  std::vector<std::vector<StepMetrics>> metrics;  // per rank
  Count dense, experts;                           // rank 0's stage's parameters
};

Job train(const Case& c) {
  const int world = c.dp * c.ep * c.cp;
  Job run;
  run.metrics.resize(world);
  std::mutex mu;
  testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(comm, {1, c.dp, c.ep, c.cp, 1}, {"pp", "dp", "ep", "cp", "tp"});
    GPTStage stage(mesh, config(c.ep));
    cohort::GradientSynchronizerOptions sync_options;
    sync_options.expert_parameters = stage->expert_parameters();
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), {}, stage->shared_embedding_weight(),
                                      sync_options);
    auto rt = make_gpt_pipeline(mesh, stage, "1f1b", kMicro);
    torch::optim::SGD opt(rt->parameters(), 0.5);
    TrainerOptions options;
    options.accumulation_steps = kMicro;
    options.max_steps = kSteps;
    options.progress = false;
    Trainer trainer(TrainerWiring::mesh(mesh, *rt, opt, sync, gpt_tied_parameters()), options);
    auto ids = torch::randint(kVocab, {kSamples, kSeq}, at::detail::createCPUGenerator(41));
    auto targets = (ids * 5 + 3) % kVocab;
    // The rows are dealt over dp x ep, the same to every cp rank.
    const int row_rank = mesh.local_rank("dp") * c.ep + mesh.local_rank("ep");
    TensorDataSource source(stage->local_sequence(ids), stage->local_sequence(targets), kRows,
                            row_rank, c.dp * c.ep);
    auto metrics = trainer.fit(source);
    std::lock_guard<std::mutex> lock(mu);
    run.metrics[comm->rank()] = std::move(metrics);
    if (comm->rank() != 0) return;
    std::set<const void*> experts;
    for (const auto& p : stage->expert_parameters()) experts.insert(p.unsafeGetTensorImpl());
    for (const auto& p : stage->parameters()) {
      Count& count = experts.count(p.unsafeGetTensorImpl()) ? run.experts : run.dense;
      count.numel += p.numel();
      ++count.tensors;
    }
  });
  return run;
}

class MeshCommBytes : public ::testing::TestWithParam<Case> {};

TEST_P(MeshCommBytes, CountsRingAttentionAsCpAndTheGradientAverageAsDp) {
  const Case c = GetParam();
  const Job run = train(c);
  // One bucket holds every gradient (the model is under first_bucket_mb).
  ASSERT_LT(run.dense.numel * 4, 1 << 20);
  ASSERT_EQ(run.experts.tensors > 0, c.ep > 1);
  const int64_t cp = expected_cp_bytes(c.cp, c.ep);
  const int64_t dp = average_bytes(run.dense, c.dp * c.ep * c.cp, c.dp * c.ep * c.cp) +
                     average_bytes(run.experts, c.dp * c.cp);
  for (size_t r = 0; r < run.metrics.size(); ++r) {
    ASSERT_EQ(run.metrics[r].size(), static_cast<size_t>(kSteps)) << "rank " << r;
    for (size_t s = 0; s < run.metrics[r].size(); ++s) {
      const auto& m = run.metrics[r][s];
      auto bytes = [&](const char* dim) {
        const auto it = m.comm_bytes_by_dimension.find(dim);
        return it == m.comm_bytes_by_dimension.end() ? int64_t{-1} : it->second;
      };
      const std::string at = "rank " + std::to_string(r) + ", step " + std::to_string(s);
      EXPECT_EQ(bytes("cp"), cp) << at;
      EXPECT_EQ(bytes("dp"), dp) << at;
      EXPECT_EQ(bytes("tp"), 0) << at;
      EXPECT_EQ(bytes("pp"), 0) << at;
      const int64_t ep = bytes("ep");
      EXPECT_EQ(ep > 0, c.ep > 1) << at << ": " << ep;
      EXPECT_EQ(m.comm_bytes, cp + dp + ep) << at;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, MeshCommBytes,
                         ::testing::Values(Case{1, 1}, Case{2, 1}, Case{1, 2}, Case{2, 2},
                                           Case{1, 3}, Case{2, 3}, Case{1, 1, 2}, Case{1, 2, 2},
                                           Case{2, 1, 2}),
                         name_of);

}  // namespace
}  // namespace cohort::mesh_comm_bytes_test
