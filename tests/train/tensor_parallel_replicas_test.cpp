// The parameters of a model of tensor-parallel layers that are whole on
// every TP rank (a LayerNorm, the row-parallel bias) under FSDP, DDP and
// the all-reduce wiring (one Trainer per TP rank over its data-parallel
// group), ranks as threads at dp × tp = 1×1, 1×2, 2×2, 1×3, 3×2 and 2×3.
// Drawn from the same seed on every TP rank, they train as one process
// (each step's loss within 1e-6 relative, the replicas bitwise equal across
// each TP group). Drawn apart, the wiring refuses them on every rank,
// naming the parameter and the TP ranks that differ: a LayerNorm drawn from
// a seed of the last TP rank's own, and a frozen LayerNorm bias whose last
// element alone differs there (under FSDP at dp above 1 one data-parallel
// rank's shard alone holds it, and the others are refused too).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/rank_errors.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"
#include "train_fixtures.h"

namespace cohort::tensor_parallel_replicas_test {
namespace {

namespace fsdp_test = cohort::testing::fsdp_test;
using fsdp_test::Named;

constexpr int kSteps = 3;
constexpr int64_t kBatch = 12;              // divides by dp 1, 2 and 3
constexpr int64_t kWidth = 4, kHidden = 6;  // kHidden divides by tp 1, 2 and 3
constexpr uint64_t kLnSeed = 100;
constexpr double kLr = 0.1;

// How the last TP rank's replicas differ from the others'.
enum class Apart {
  None,        // every TP rank draws the same values
  Seed,        // the LayerNorm drawn from a seed of the last TP rank's own
  FrozenLast,  // the frozen LayerNorm bias: its last element alone
};

// y = Row(tanh(Column(LayerNorm(x)))): the LayerNorm and Row's bias are
// whole on every TP rank, the Column and Row weights split over it.
struct ReplicaModelImpl : torch::nn::Module {
  torch::nn::LayerNorm ln{nullptr};
  tensor_parallel::ColumnParallelLinear col{nullptr};
  tensor_parallel::RowParallelLinear row{nullptr};

  ReplicaModelImpl(const std::shared_ptr<Communicator>& group, Apart apart) {
    const auto tp = DeviceMesh::from_group(group, "tp");
    const bool last = group->size() > 1 && group->rank() == group->size() - 1;
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})));
    tensor_parallel::ColumnParallelLinearOptions c;
    c.seed = 11;
    col = register_module("col", tensor_parallel::ColumnParallelLinear(tp, kWidth, kHidden, c));
    tensor_parallel::RowParallelLinearOptions r;
    r.seed = 12;
    row = register_module("row", tensor_parallel::RowParallelLinear(tp, kHidden, kWidth, r));
    auto gen = testing::make_generator(apart == Apart::Seed && last ? kLnSeed + 1 : kLnSeed);
    torch::NoGradGuard no_grad;
    ln->weight.copy_(1 + 0.3 * torch::randn({kWidth}, gen));
    ln->bias.copy_(0.3 * torch::randn({kWidth}, gen));
    if (apart == Apart::FrozenLast) {
      if (last) ln->bias[kWidth - 1].add_(0.01);
      ln->bias.requires_grad_(false);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return row(torch::tanh(col(ln(x)))); }
};
TORCH_MODULE(ReplicaModel);

enum class Mode { Fsdp, Ddp, AllReduce };

struct Case {
  Mode mode;
  int dp, tp;
};

const char* mode_name(Mode mode) {
  const char* modes[] = {"fsdp", "ddp", "all_reduce"};
  return modes[static_cast<int>(mode)];
}

std::string case_text(const Case& c) {
  return std::string(mode_name(c.mode)) + "_dp" + std::to_string(c.dp) + "_tp" +
         std::to_string(c.tp);
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_text(c); }

// The Trainer of `mode` over this rank's model (every part it needs kept alive).
struct Wired {
  ReplicaModel model{nullptr};
  FullyShard root{nullptr};
  std::unique_ptr<DistributedDataParallel<ReplicaModel>> ddp;
  std::unique_ptr<torch::optim::SGD> opt;
  std::optional<Trainer> trainer;

  Wired(Mode mode, const DeviceMesh& mesh, Apart apart) {
    const auto dp = mesh["dp"].process_group();
    model = ReplicaModel(mesh["tp"].process_group(), apart);
    const auto sgd = torch::optim::SGDOptions(kLr);
    std::optional<TrainerWiring> wiring;
    LossFn loss;
    if (mode == Mode::Fsdp) {
      root = fully_shard(torch::nn::AnyModule(model), dp);
      opt = std::make_unique<torch::optim::SGD>(root->parameters(), sgd);
      wiring.emplace(TrainerWiring::fsdp(root, *opt));
      loss = [this](const torch::data::Example<>& b) {
        return torch::mse_loss(root->forward(b.data), b.target);
      };
    } else if (mode == Mode::Ddp) {
      ddp = std::make_unique<DistributedDataParallel<ReplicaModel>>(model, dp);
      opt = std::make_unique<torch::optim::SGD>(model->parameters(), sgd);
      wiring.emplace(TrainerWiring::ddp(*ddp, *opt));
      loss = [this](const torch::data::Example<>& b) {
        return torch::mse_loss(ddp->forward(b.data), b.target);
      };
    } else {
      opt = std::make_unique<torch::optim::SGD>(model->parameters(), sgd);
      wiring.emplace(TrainerWiring::all_reduce(model.ptr(), *opt, dp));
      loss = [this](const torch::data::Example<>& b) {
        return torch::mse_loss(model->forward(b.data), b.target);
      };
    }
    TrainerOptions config;
    config.progress = false;
    trainer.emplace(std::move(*wiring), loss, config);
  }

  // This rank's parameters, whole over dp (its TP slices of the split ones).
  Named params() {
    if (!root.is_empty()) return root->full_state_dict();
    Named out;
    for (const auto& p : model->named_parameters()) {
      out.insert(p.key(), p.value().detach().clone());
    }
    return out;
  }
};

bool replicated_over_tp(const std::string& name) {
  return name.find("ln.") != std::string::npos || name.find("row.bias") != std::string::npos;
}

struct RankRun {
  std::vector<double> losses;
  Named params;
};

// One process (tp = 1), the whole batch, plain SGD: TP rank 0's model.
RankRun reference_run(const testing::StepBatches& d) {
  RankRun ref;
  testing::run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    ReplicaModel model(comm, Apart::None);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      auto loss = torch::mse_loss(model->forward(d.x[s]), d.y[s]);
      ref.losses.push_back(loss.item<double>());
      loss.backward();
      opt.step();
    }
    for (const auto& p : model->named_parameters()) {
      ref.params.insert(p.key(), p.value().detach().clone());
    }
  });
  return ref;
}

// kSteps of this rank's Trainer over its data-parallel share of `d`.
RankRun train(Wired& w, const DeviceMesh& mesh, const testing::StepBatches& d) {
  const auto& dp = *mesh["dp"].process_group();
  RankRun run;
  for (int s = 0; s < kSteps; ++s) {
    const auto m =
        w.trainer->train_step({{fsdp_test::local(d.x[s], dp), fsdp_test::local(d.y[s], dp)}});
    run.losses.push_back(m.loss);
  }
  run.params = w.params();
  return run;
}

const torch::Tensor* find_suffix(const Named& params, const std::string& suffix) {
  for (const auto& p : params) {
    const auto& k = p.key();
    if (k.size() >= suffix.size() &&
        k.compare(k.size() - suffix.size(), suffix.size(), suffix) == 0)
      return &p.value();
  }
  return nullptr;
}

class TensorParallelReplicas : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelReplicas, EqualReplicasTrainAsOneProcess) {
  const Case c = GetParam();
  const auto data = testing::make_step_batches(kSteps, kBatch, kWidth, kWidth);
  const RankRun ref = reference_run(data);
  std::mutex mu;
  std::map<std::pair<int, int>, RankRun> runs;  // (dp rank, tp rank) -> its run
  testing::run_ranks_shared(c.dp * c.tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {c.dp, c.tp}, {"dp", "tp"});
    Wired w(c.mode, mesh, Apart::None);
    RankRun run = train(w, mesh, data);
    std::lock_guard<std::mutex> lock(mu);
    runs[{mesh.local_rank("dp"), mesh.local_rank("tp")}] = std::move(run);
  });
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.dp * c.tp));
  for (const auto& [at, run] : runs) {
    const std::string rank =
        "dp rank " + std::to_string(at.first) + ", tp rank " + std::to_string(at.second);
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(run.losses[s], ref.losses[s], 1e-6 * ref.losses[s]) << rank << ", step " << s;
    }
    const auto& first = runs.at({at.first, 0}).params;
    for (const auto& p : run.params) {
      if (!replicated_over_tp(p.key())) continue;
      EXPECT_TRUE(torch::equal(p.value(), first[p.key()])) << rank << ": '" << p.key() << "'";
      const auto* want = ref.params.find(p.key());
      ASSERT_NE(want, nullptr) << p.key();
      EXPECT_LT((p.value() - *want).abs().max().item<double>(),
                1e-6 * want->abs().max().item<double>())
          << rank << ": '" << p.key() << "'";
    }
  }
}

// Replicas drawn apart are refused on every rank when the wiring is made;
// without the refusal the ranks train apart, and the failure says how far.
TEST_P(TensorParallelReplicas, ReplicasThatDifferAreRefusedOnEveryRank) {
  const Case c = GetParam();
  const auto data = testing::make_step_batches(kSteps, kBatch, kWidth, kWidth);
  const RankRun ref = reference_run(data);
  for (Apart apart : {Apart::Seed, Apart::FrozenLast}) {
    const std::string param = apart == Apart::Seed ? "ln.weight" : "ln.bias";
    std::mutex mu;
    std::map<int, std::pair<int, int>> at;  // world rank -> (dp rank, tp rank)
    std::map<int, RankRun> runs;            // world rank -> its run, where none refused
    std::vector<bool> invalid(static_cast<size_t>(c.dp * c.tp), false);
    const auto errors =
        testing::errors_on_every_rank(c.dp * c.tp, [&](std::shared_ptr<Communicator> world) {
          torch::set_num_threads(1);
          auto mesh = init_device_mesh(world, {c.dp, c.tp}, {"dp", "tp"});
          {
            std::lock_guard<std::mutex> lock(mu);
            at[world->rank()] = {mesh.local_rank("dp"), mesh.local_rank("tp")};
          }
          try {
            Wired w(c.mode, mesh, apart);
            RankRun run = train(w, mesh, data);
            std::lock_guard<std::mutex> lock(mu);
            runs[world->rank()] = std::move(run);
          } catch (const InvalidArgument&) {
            invalid[static_cast<size_t>(world->rank())] = true;
            throw;
          }
        });
    for (size_t r = 0; r < errors.size(); ++r) {
      const auto& e = errors[r];
      const std::string where =
          case_text(c) + (apart == Apart::Seed ? ", seeded apart" : ", frozen last element") +
          ", rank " + std::to_string(r) + ": ";
      if (c.tp == 1) {  // one TP rank: nothing to compare
        EXPECT_EQ(e, testing::kNoError) << where;
        continue;
      }
      if (e == testing::kNoError) {
        // The figures of the silent run: the replica and the loss against
        // one process with TP rank 0's values.
        const auto& run = runs.at(static_cast<int>(r));
        int peer = -1;
        for (const auto& [w, dt] : at) {
          if (dt.first == at.at(static_cast<int>(r)).first && dt.second == c.tp - 1) peer = w;
        }
        if (!runs.count(peer)) {
          ADD_FAILURE() << where << "no error here, but the last TP rank refused";
          continue;
        }
        std::ostringstream figures;
        const auto* mine = find_suffix(run.params, param);
        const auto* theirs = find_suffix(runs.at(peer).params, param);
        figures << "after " << kSteps << " steps '" << param
                << "' differs from the last TP rank's by "
                << (*mine - *theirs).abs().max().item<double>() << "; losses";
        for (int s = 0; s < kSteps; ++s) {
          figures << " " << run.losses[s] << " (one process " << ref.losses[s] << ")";
        }
        ADD_FAILURE() << where << "no error: " << figures.str();
        continue;
      }
      EXPECT_TRUE(invalid[r]) << where << e;
      for (const std::string& part :
           {std::string("TrainerWiring::") + mode_name(c.mode), param + "'",
            std::string("differ across TP ranks"), std::string("tp rank 0"),
            "tp rank " + std::to_string(c.tp - 1)}) {
        EXPECT_NE(e.find(part), std::string::npos) << where << "'" << part << "' missing in: " << e;
      }
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Mode mode : {Mode::Fsdp, Mode::Ddp, Mode::AllReduce}) {
    for (const auto& [dp, tp] :
         std::vector<std::pair<int, int>>{{1, 1}, {1, 2}, {2, 2}, {1, 3}, {3, 2}, {2, 3}}) {
      out.push_back({mode, dp, tp});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Trainer, TensorParallelReplicas, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return case_text(info.param);
                         });

}  // namespace
}  // namespace cohort::tensor_parallel_replicas_test
