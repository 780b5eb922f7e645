// The ranks of one context-parallel group hold different positions of the
// same sequences, so their batches differ by design and no content digest
// can tell whether they drew the same samples: a data source sharded over
// the world rather than the data-parallel group deals each cp rank other
// rows of the same shape, and ring attention would splice them together
// without an error. fit() compares the first micro-batch's sample indices
// (DataSource::sample_indices) within each cp group and refuses such a
// source on every rank (when one cp group alone differs, the other ranks
// name it); sharded over dp it trains, and its parameters equal one
// process's trained on the whole sequences. A source that gives no sample
// indices is refused under cp > 1 (TrainerWiring::mesh on the example GPT,
// ranks as threads; TensorDataSource and SampledDataSource).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <map>
#include <mutex>

#include "cohort/core/error.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/train/sampled_data_source.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/thread_ranks.h"

namespace cohort::mesh_context_data_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kSamples = 32, kMicro = 2, kSteps = 2, kVocab = 8, kSeq = 12;

// Unindexed: a TensorDataSource behind a source that gives no sample
// indices.
enum class Source { Tensor, Sampled, Unindexed };

class Unindexed : public DataSource {
 public:
  explicit Unindexed(std::unique_ptr<DataSource> inner) : inner_(std::move(inner)) {}
  void set_epoch(int64_t epoch) override { inner_->set_epoch(epoch); }
  int64_t num_batches() const override { return inner_->num_batches(); }
  torch::data::Example<> batch(int64_t index) override { return inner_->batch(index); }

 private:
  std::unique_ptr<DataSource> inner_;
};

const char* source_name(Source s) {
  return s == Source::Tensor ? "tensor" : s == Source::Sampled ? "sampled" : "unindexed";
}

// How the ranks deal: over the data-parallel group; over the world (the
// wrong sharding); over dp but the last rank as data-parallel rank 0 (its
// cp group alone differs).
enum class Deal { Dp, World, LastRankOff };

struct Case {
  int dp, cp;
  Source source;
  Deal deal;
};

const char* deal_name(Deal d) {
  return d == Deal::Dp ? "dp_sharded" : d == Deal::World ? "world_sharded" : "last_rank_off";
}

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "dp" + std::to_string(c.dp) + "_cp" + std::to_string(c.cp) + "_" + source_name(c.source) +
         "_" + deal_name(c.deal);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << "dp " << c.dp << " cp " << c.cp << " " << source_name(c.source) << " "
      << deal_name(c.deal);
}

GPTConfig config() {
  GPTConfig c;
  c.vocab_size = kVocab;
  c.seq_len = kSeq;  // 2 cp chunks of 6 or 3 of 4: zig-zag at cp 2 and 3
  c.hidden = 8;
  c.heads = 2;
  c.layers = 2;
  c.seed = 7;
  return c;
}

// The whole dataset: random ids, learnable targets.
std::pair<torch::Tensor, torch::Tensor> dataset() {
  auto ids = torch::randint(kVocab, {kSamples, kSeq}, at::detail::createCPUGenerator(41));
  return {ids, (ids * 5 + 3) % kVocab};
}

using Parameters = std::map<std::string, torch::Tensor>;

struct Result {
  std::vector<std::string> errors;
  std::vector<int64_t> steps;
  Parameters params;  // rank 0's
};

// Trains `c` over the mesh pp 1 x dp x ep 1 x cp x tp 1, each rank's data
// source over its columns of the dataset.
Result train(const Case& c) {
  const int world = c.dp * c.cp;
  Result result{std::vector<std::string>(world), std::vector<int64_t>(world, -1), {}};
  std::mutex mu;
  testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(comm, {1, c.dp, 1, c.cp, 1}, {"pp", "dp", "ep", "cp", "tp"});
    GPTStage stage(mesh, config());
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), {}, stage->shared_embedding_weight());
    auto rt = make_gpt_pipeline(mesh, stage, "1f1b", kMicro);
    torch::optim::SGD opt(rt->parameters(), 0.5);
    TrainerOptions options;
    options.accumulation_steps = kMicro;
    options.max_steps = kSteps;
    options.progress = false;
    Trainer trainer(TrainerWiring::mesh(mesh, *rt, opt, sync, gpt_tied_parameters()), options);
    const auto [ids, targets] = dataset();
    const auto local_ids = stage->local_sequence(ids),
               local_targets = stage->local_sequence(targets);
    auto group = c.deal == Deal::World ? comm : mesh["dp"].process_group();
    const int rank = c.deal == Deal::LastRankOff && comm->rank() == world - 1 ? 0 : group->rank();
    std::unique_ptr<DataSource> source;
    if (c.source != Source::Sampled) {
      source =
          std::make_unique<TensorDataSource>(local_ids, local_targets, kMicro, rank, group->size());
      if (c.source == Source::Unindexed) source = std::make_unique<Unindexed>(std::move(source));
    } else {
      source = std::make_unique<SampledDataSource>(local_ids, local_targets, kMicro,
                                                   data::DistributedSampler(kSamples, *group));
    }
    try {
      const auto done = trainer.fit(*source);
      std::lock_guard<std::mutex> lock(mu);
      result.steps[comm->rank()] = static_cast<int64_t>(done.size());
      if (comm->rank() != 0) return;
      for (const auto& p : stage->named_parameters()) {
        result.params[p.key()] = p.value().detach().clone();
      }
    } catch (const InvalidArgument& e) {
      std::lock_guard<std::mutex> lock(mu);
      result.errors[comm->rank()] = e.what();
    }
  });
  return result;
}

// One process on the whole sequences, each micro-batch the dp ranks'
// micro-batches of the same index together: the parameters before and
// after.
std::pair<Parameters, Parameters> reference(const Case& c) {
  Parameters before, after;
  testing::run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(comm, {1, 1, 1, 1, 1}, {"pp", "dp", "ep", "cp", "tp"});
    GPTStage stage(mesh, config());
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), {}, stage->shared_embedding_weight());
    auto rt = make_gpt_pipeline(mesh, stage, "1f1b", kMicro);
    torch::optim::SGD opt(rt->parameters(), 0.5);
    TrainerOptions options;
    options.accumulation_steps = kMicro;
    options.max_steps = kSteps;
    options.progress = false;
    Trainer trainer(TrainerWiring::mesh(mesh, *rt, opt, sync, gpt_tied_parameters()), options);
    auto [ids, targets] = dataset();
    std::unique_ptr<DataSource> source;
    if (c.source == Source::Tensor) {
      // The same global order at any world size (TensorDataSource).
      source = std::make_unique<TensorDataSource>(ids, targets, kMicro * c.dp, 0, 1);
    } else {
      // Replica r's micro-batch k is its indices [k micro, (k + 1) micro).
      std::vector<std::vector<size_t>> dealt;
      for (int r = 0; r < c.dp; ++r) {
        data::DistributedSamplerOptions deal;
        deal.num_replicas = c.dp;
        deal.rank = r;
        dealt.push_back(data::DistributedSampler(kSamples, deal).indices());
      }
      std::vector<int64_t> order;
      for (size_t k = 0; k + kMicro <= dealt[0].size(); k += kMicro) {
        for (const auto& mine : dealt) order.insert(order.end(), &mine[k], &mine[k] + kMicro);
      }
      const auto rows = torch::tensor(order, torch::kInt64);
      source = std::make_unique<TensorDataSource>(ids.index_select(0, rows),
                                                  targets.index_select(0, rows), kMicro * c.dp, 0,
                                                  1, /*shuffle=*/false);
    }
    for (const auto& p : stage->named_parameters()) before[p.key()] = p.value().detach().clone();
    trainer.fit(*source);
    for (const auto& p : stage->named_parameters()) after[p.key()] = p.value().detach().clone();
  });
  return {before, after};
}

class MeshContextData : public ::testing::TestWithParam<Case> {};

TEST_P(MeshContextData, EveryRankOfAContextParallelGroupDrawsTheSameSamples) {
  const Case c = GetParam();
  const auto got = train(c);
  const int world = c.dp * c.cp;
  if (c.source == Source::Unindexed) {
    // Refused however it deals: nothing shows what the cp ranks read.
    for (int r = 0; r < world; ++r) {
      const auto& e = got.errors[r];
      EXPECT_EQ(got.steps[r], -1) << "rank " << r << " trained";
      EXPECT_NE(e.find("gives no sample indices (DataSource::sample_indices)"), std::string::npos)
          << e;
    }
    return;
  }
  if (c.deal == Deal::LastRankOff) {
    // The last cp group names itself; the others name it as the ranks
    // that found it.
    std::string last = "ranks ";
    for (int i = world - c.cp; i < world; ++i)
      last += (i > world - c.cp ? ", " : "") + std::to_string(i);
    for (int r = 0; r < world; ++r) {
      const auto& e = got.errors[r];
      EXPECT_EQ(got.steps[r], -1) << "rank " << r << " trained";
      EXPECT_NE(e.find(r < world - c.cp ? last + " found the samples" : "context-parallel"),
                std::string::npos)
          << e;
    }
    return;
  }
  if (c.deal == Deal::World) {
    for (int r = 0; r < world; ++r) {
      const auto& e = got.errors[r];
      EXPECT_EQ(got.steps[r], -1) << "rank " << r << " trained";
      EXPECT_NE(e.find("must all draw the same samples"), std::string::npos) << e;
      EXPECT_NE(e.find("context-parallel"), std::string::npos) << e;
    }
    // The cp group's ranks name it, by its world ranks (the last dimension
    // but tp: consecutive).
    for (int r = 0; r < world; ++r) {
      std::string ranks = "ranks ";
      for (int i = 0; i < c.cp; ++i) ranks += (i ? ", " : "") + std::to_string(r / c.cp * c.cp + i);
      EXPECT_NE(got.errors[r].find(ranks), std::string::npos) << got.errors[r];
    }
    return;
  }
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(got.errors[r], "") << "rank " << r;
    EXPECT_EQ(got.steps[r], kSteps) << "rank " << r;
  }
  const auto [initial, ref] = reference(c);
  ASSERT_EQ(got.params.size(), ref.size());
  double moved = 0;
  for (const auto& [name, value] : ref) {
    moved = std::max(moved, (value - initial.at(name)).abs().max().item<double>());
  }
  ASSERT_GT(moved, 1e-2) << "the reference did not train";
  for (const auto& [name, value] : ref) {
    const double scale = std::max(value.abs().max().item<double>(), 1e-12);
    EXPECT_LE((got.params.at(name) - value).abs().max().item<double>() / scale, 1e-5) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Trainer, MeshContextData,
                         ::testing::Values(Case{2, 2, Source::Tensor, Deal::World},
                                           Case{1, 3, Source::Tensor, Deal::World},
                                           Case{2, 2, Source::Sampled, Deal::World},
                                           Case{1, 3, Source::Sampled, Deal::World},
                                           Case{2, 2, Source::Tensor, Deal::Dp},
                                           Case{1, 3, Source::Tensor, Deal::Dp},
                                           Case{2, 2, Source::Sampled, Deal::Dp},
                                           Case{1, 1, Source::Tensor, Deal::Dp},
                                           Case{2, 2, Source::Tensor, Deal::LastRankOff},
                                           Case{2, 2, Source::Unindexed, Deal::Dp},
                                           Case{1, 3, Source::Unindexed, Deal::Dp}),
                         name_of);

}  // namespace
}  // namespace cohort::mesh_context_data_test
