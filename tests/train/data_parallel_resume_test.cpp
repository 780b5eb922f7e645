// Which samples fit() trains on when a checkpoint written in the middle of an
// epoch resumes at the same world size with another data-parallel size
// (dp 2 -> tp 2, dp 2 x tp 2 -> dp 4, dp 2 x pp 2 -> pp 4, dp 3 -> pp 3):
// TrainerWiring::mesh on the example GPT, ranks as threads, Gloo and UCX.
// Each data-parallel replica's first rank records the sample indices of
// every step. A TensorDataSource and a SampledDataSource (a
// DistributedSampler over the mesh's dp group) continue the epoch's global
// order, also with the global batch cut into other micro-batches and
// accumulation: the epoch trains every sample once. A source without a
// global order (contiguous shards per dp rank), whose micro-batch index
// counts another dp size's shares, is refused on every rank before any
// step, naming both data-parallel sizes.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/mesh/mesh_sampler.h"
#include "cohort/train/sampled_data_source.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/engine_worlds.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"

namespace cohort::data_parallel_resume_test {
namespace {

using namespace cohort::tensor_parallel;
using Indices = std::vector<int64_t>;

constexpr int64_t kSamples = 24, kSeq = 4, kVocab = 8;

enum class Kind { Tensor, Sampled, Contiguous };

const char* kind_name(Kind k) {
  return k == Kind::Tensor    ? "TensorDataSource"
         : k == Kind::Sampled ? "SampledDataSource"
                              : "contiguous shards";
}

// One job's layout and cut of the global batch.
struct Layout {
  int pp, dp, tp;
  int64_t micro, accumulation;
  int world() const { return pp * dp * tp; }
  int64_t global_batch() const { return micro * accumulation * dp; }
  std::string name() const {
    return "pp" + std::to_string(pp) + "_dp" + std::to_string(dp) + "_tp" + std::to_string(tp) +
           "_m" + std::to_string(micro) + "_k" + std::to_string(accumulation);
  }
};

struct Change {
  Layout from, to;
  int64_t layers;
};

// Dp rank d deals samples [d n / D, (d + 1) n / D) in order, m at a time:
// no global order, its index means a share of D.
class ContiguousShards : public DataSource {
 public:
  ContiguousShards(torch::Tensor x, torch::Tensor y, int64_t micro, int dp_rank, int dp)
      : x_(std::move(x)),
        y_(std::move(y)),
        micro_(micro),
        first_(dp_rank * (kSamples / dp)),
        rows_(kSamples / dp) {}
  void set_epoch(int64_t) override {}
  int64_t num_batches() const override { return rows_ / micro_; }
  torch::data::Example<> batch(int64_t index) override {
    const auto rows = sample_indices(index);
    return {x_.index_select(0, rows), y_.index_select(0, rows)};
  }
  torch::Tensor sample_indices(int64_t index) override {
    return torch::arange(first_ + index * micro_, first_ + (index + 1) * micro_, torch::kInt64);
  }

 private:
  torch::Tensor x_, y_;
  int64_t micro_, first_, rows_;
};

// Forwards to `inner`, keeping the sample indices of each micro-batch read.
class Recorded : public DataSource {
 public:
  explicit Recorded(std::unique_ptr<DataSource> inner) : inner_(std::move(inner)) {}
  void set_epoch(int64_t epoch) override { inner_->set_epoch(epoch); }
  int64_t num_batches() const override { return inner_->num_batches(); }
  torch::data::Example<> batch(int64_t index) override {
    const auto idx = inner_->sample_indices(index).contiguous();
    reads.emplace_back(idx.data_ptr<int64_t>(), idx.data_ptr<int64_t>() + idx.numel());
    return inner_->batch(index);
  }
  int64_t global_micro_batch() const override { return inner_->global_micro_batch(); }
  bool resumes_over_another_dataset() const override {
    return inner_->resumes_over_another_dataset();
  }
  torch::Tensor sample_indices(int64_t index) override { return inner_->sample_indices(index); }
  DataShard shard() const override { return inner_->shard(); }
  std::string order_settings() const override { return inner_->order_settings(); }

  std::vector<Indices> reads;

 private:
  std::unique_ptr<DataSource> inner_;
};

struct Outcome {
  std::vector<std::string> errors;                  // by rank
  std::map<int64_t, std::vector<int64_t>> trained;  // step -> every replica's samples
  std::map<int64_t, int64_t> epoch_of;              // step -> epoch
};

GPTConfig gpt_config(int64_t layers, uint64_t seed) {
  GPTConfig c;
  c.vocab_size = kVocab;
  c.seq_len = kSeq;
  c.hidden = 8;
  c.heads = 2;
  c.layers = layers;
  c.seed = seed;
  return c;
}

Outcome run(const std::string& backend, const std::string& dir, const Layout& l, int64_t layers,
            Kind kind, int64_t max_steps, bool resume) {
  Outcome out;
  out.errors.resize(static_cast<size_t>(l.world()));
  std::mutex mu;
  testing::ThreadRanksOptions options;
  options.backend = backend;
  testing::run_ranks_shared(
      l.world(),
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(comm, {l.pp, l.dp, l.tp}, {"pp", "dp", "tp"});
        GPTStage stage(mesh, gpt_config(layers, resume ? 8 : 7));
        cohort::GradientSynchronizer sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
                                          stage->shared_embedding_weight());
        auto rt = make_gpt_pipeline(mesh, stage, "1f1b", static_cast<int>(l.accumulation));
        torch::optim::SGD opt(rt->parameters(), 0.1);
        TrainerOptions config;
        config.accumulation_steps = l.accumulation;
        config.epochs = 1;
        config.max_steps = max_steps;
        config.checkpoint_dir = dir;
        config.progress = false;
        Trainer trainer(TrainerWiring::mesh(mesh, *rt, opt, sync, gpt_tied_parameters()), config);
        const auto ids =
            torch::randint(kVocab, {kSamples, kSeq}, at::detail::createCPUGenerator(3));
        const auto targets = (ids * 5 + 3) % kVocab;
        const int dp_rank = mesh.local_rank("dp");
        std::unique_ptr<DataSource> inner;
        if (kind == Kind::Tensor) {
          inner = std::make_unique<TensorDataSource>(ids, targets, l.micro, dp_rank, l.dp);
        } else if (kind == Kind::Sampled) {
          inner = std::make_unique<SampledDataSource>(ids, targets, l.micro,
                                                      distributed_sampler(kSamples, mesh, "dp"));
        } else {
          inner = std::make_unique<ContiguousShards>(ids, targets, l.micro, dp_rank, l.dp);
        }
        Recorded source(std::move(inner));
        // The replica's first rank speaks for it; the step's micro-batches are
        // the last k read (fit() reads micro-batch 0 again at an epoch's start).
        const bool speaks = mesh.local_rank("pp") == 0 && mesh.local_rank("tp") == 0;
        FitCallbacks callbacks;
        callbacks.on_step = [&](const StepMetrics& m) {
          if (!speaks) return;
          std::lock_guard<std::mutex> lock(mu);
          auto& step = out.trained[m.step];
          for (size_t i = source.reads.size() - static_cast<size_t>(l.accumulation);
               i < source.reads.size(); ++i) {
            step.insert(step.end(), source.reads[i].begin(), source.reads[i].end());
          }
          out.epoch_of[m.step] = m.epoch;
        };
        std::string error;
        try {
          if (resume) trainer.resume();
          trainer.fit(source, callbacks);
        } catch (const Error& e) {
          error = e.what();
        }
        std::lock_guard<std::mutex> lock(mu);
        out.errors[static_cast<size_t>(comm->rank())] = error;
      },
      options);
  return out;
}

// How many of epoch 0's samples the steps of `a` then `b` trained more than
// once, and how many never.
std::string coverage(const Outcome& a, const Outcome& b) {
  std::map<int64_t, int> count;
  for (const Outcome* o : {&a, &b}) {
    for (const auto& [step, samples] : o->trained) {
      if (o->epoch_of.at(step) != 0) continue;
      for (const int64_t i : samples) ++count[i];
    }
  }
  int64_t repeated = 0;
  for (const auto& [i, c] : count) repeated += c > 1;
  return std::to_string(repeated) + " samples trained more than once, " +
         std::to_string(kSamples - static_cast<int64_t>(count.size())) + " of " +
         std::to_string(kSamples) + " never";
}

const std::string kOnce =
    "0 samples trained more than once, 0 of " + std::to_string(kSamples) + " never";

struct Case {
  std::string backend;
  Change change;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << " " << c.change.from.name() << " to " << c.change.to.name();
}

class DataParallelResume : public ::testing::TestWithParam<Case> {};

// Two steps (one for a global batch of 8), then resumed at the other layout
// to the epoch's end.
TEST_P(DataParallelResume, AGlobalOrderContinuesAnIndexIsRefused) {
  const Case c = GetParam();
  const Change& ch = c.change;
  ASSERT_EQ(ch.from.world(), ch.to.world());
  ASSERT_EQ(ch.from.global_batch(), ch.to.global_batch());
  const int64_t per_epoch = kSamples / ch.from.global_batch();
  const int64_t first_steps = per_epoch > 3 ? 2 : 1;
  for (const Kind kind : {Kind::Tensor, Kind::Sampled, Kind::Contiguous}) {
    SCOPED_TRACE(kind_name(kind));
    testing::TempDir dir("cohort-dp-resume");
    const auto a = run(c.backend, dir.str(), ch.from, ch.layers, kind, first_steps, false);
    ASSERT_EQ(a.errors, std::vector<std::string>(static_cast<size_t>(ch.from.world())));
    ASSERT_EQ(static_cast<int64_t>(a.trained.size()), first_steps);
    const auto b = run(c.backend, dir.str(), ch.to, ch.layers, kind, 0, true);
    const std::string trained = coverage(a, b);
    if (kind == Kind::Contiguous) {
      EXPECT_TRUE(b.trained.empty()) << "trained on: " << trained;
      for (int r = 0; r < ch.to.world(); ++r) {
        const auto& e = b.errors[static_cast<size_t>(r)];
        EXPECT_NE(e.find("Trainer::fit on rank " + std::to_string(r) +
                         ": resumed in the middle of epoch 0"),
                  std::string::npos)
            << e << " (" << trained << ")";
        EXPECT_NE(e.find("data-parallel size " + std::to_string(ch.to.dp)), std::string::npos) << e;
        EXPECT_NE(e.find("data-parallel size " + std::to_string(ch.from.dp)), std::string::npos)
            << e;
      }
      continue;
    }
    ASSERT_EQ(b.errors, std::vector<std::string>(static_cast<size_t>(ch.to.world()))) << trained;
    EXPECT_EQ(static_cast<int64_t>(b.trained.size()), per_epoch - first_steps);
    EXPECT_EQ(trained, kOnce);
  }
}

std::vector<Case> cases() {
  // {pp, dp, tp, micro, accumulation}, the global batch kept (4, 6 at world
  // 3, 8 at pp 4); the second and fourth cut it into other global
  // micro-batches (micro x dp) and accumulation.
  const std::vector<Change> changes = {
      {{1, 2, 1, 1, 2}, {1, 1, 2, 2, 2}, 2},  // dp 2 -> tp 2
      {{1, 2, 1, 1, 2}, {1, 1, 2, 1, 4}, 2},  // and micro-batches of 1 a step
      {{1, 3, 1, 1, 2}, {3, 1, 1, 3, 2}, 3},  // dp 3 -> pp 3
      {{1, 2, 2, 1, 2}, {1, 4, 1, 1, 1}, 2},  // dp 2 x tp 2 -> dp 4
      {{2, 2, 1, 2, 2}, {4, 1, 1, 4, 2}, 4},  // dp 2 x pp 2 -> pp 4
  };
  std::vector<Case> out;
  for (const auto& e : testing::engine_worlds({1})) {
    for (const auto& ch : changes) out.push_back({e.backend, ch});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Trainer, DataParallelResume, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Change& ch = info.param.change;
                           return info.param.backend + "_" + ch.from.name() + "_to_" + ch.to.name();
                         });

}  // namespace
}  // namespace cohort::data_parallel_resume_test
