// set_requires_gradient_sync on some units only (FSDP2's, with recurse),
// ranks as threads over Gloo and UCX at world 1 to 3: gradient accumulation
// over 2 micro-batches where the units named skip their reduce-scatter on
// the first (their full gradients accumulate locally) and the others
// reduce every micro-batch. After the synchronizing micro-batch of each of
// 10 AdamW steps, every parameter equals the one-process model's (whole
// batch) within 1e-6 relative:
//
//   an inner unit holding a unit (recurse: both skip; not recurse: the
//   inner one alone), the root without recurse (its own parameters alone),
//   and the root with recurse (every unit, as before).
//
// A gradient shard left in .grad by a synchronizing backward and put aside
// by a backward without sync goes with zero_grad (set to none or in place)
// before the next synchronizing backward, and is added into its result
// without one: every rank's .grad is its rows of one process's.
//
// A setting that differs between ranks is a MismatchError on every rank
// naming the unit. The Trainer's skip_sync (FSDPGradientSync) around a
// step's first micro-batch leaves each unit's own setting as it found it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "cohort/fsdp/fsdp_adapters.h"
#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::gradient_sync_test {
namespace {

using namespace cohort::testing::fsdp_test;
using cohort::testing::EngineWorld;

constexpr int kMicro = 2;  // divides every rank's rows (12, 6, 4)

// The middle of the model: a = Linear(7, 6) (a unit of its own when
// sharded), then tanh, then b = Linear(6, 7).
struct MiddleImpl : torch::nn::Module {
  AnyModule a;
  Linear b{nullptr};
  explicit MiddleImpl(AnyModule first) : a(std::move(first)) {
    register_module("a", a.ptr());
    b = register_module("b", Linear(6, 7));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return b(torch::tanh(a.forward<torch::Tensor>(x)));
  }
};
TORCH_MODULE(Middle);

// Linear(5, 7), Tanh, Middle, Tanh, Linear(7, 5). Sharded: the middle is a
// unit holding b and a unit around a; the rest is the root's.
struct Model {
  Sequential seq;
  FullyShard root{nullptr}, middle{nullptr};
};

Model make(const std::shared_ptr<Communicator>& comm) {
  Model m;
  m.seq->push_back(Linear(5, 7));
  m.seq->push_back(Tanh());
  if (comm) {
    m.middle =
        FullyShard(AnyModule(Middle(AnyModule(FullyShard(AnyModule(Linear(7, 6)), comm)))), comm);
    m.seq->push_back(m.middle);
  } else {
    m.seq->push_back(Middle(AnyModule(Linear(7, 6))));
  }
  m.seq->push_back(Tanh());
  m.seq->push_back(Linear(7, 5));
  if (comm) m.root = fully_shard(m.seq, comm);
  return m;
}

Named reference(const Batches& b) {
  auto m = make(nullptr);
  init_parameters(*m.seq, 4);
  auto opt = make_optimizer(Opt::AdamW, m.seq->parameters());
  for (int s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    torch::mse_loss(m.seq->forward(b.x[s]), b.y[s]).backward();
    opt->step();
  }
  Named out;
  for (const auto& p : m.seq->named_parameters()) out.insert(p.key(), p.value().clone());
  return out;
}

// Which units skip the sync on all micro-batches but the last.
enum class Skip { kMiddleRecurse, kMiddleAlone, kRootAlone, kRootRecurse };

void set_sync(Model& m, Skip skip, bool sync) {
  switch (skip) {
    case Skip::kMiddleRecurse:
      return m.middle->set_requires_gradient_sync(sync);
    case Skip::kMiddleAlone:
      return m.middle->set_requires_gradient_sync(sync, /*recurse=*/false);
    case Skip::kRootAlone:
      return m.root->set_requires_gradient_sync(sync, /*recurse=*/false);
    case Skip::kRootRecurse:
      return m.root->set_requires_gradient_sync(sync);
  }
}

std::map<int, Named> accumulate(const EngineWorld& c, const Batches& b, Skip skip) {
  std::mutex mu;
  std::map<int, Named> got;
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto m = make(comm);
        auto twin = make(nullptr);
        init_parameters(*twin.seq, 4);
        load_from(m.root, *twin.seq);
        auto opt = make_optimizer(Opt::AdamW, m.root->parameters());
        for (int s = 0; s < kSteps; ++s) {
          opt->zero_grad();
          auto x = local(b.x[s], *comm), y = local(b.y[s], *comm);
          const int64_t n = x.size(0) / kMicro;
          for (int k = 0; k < kMicro; ++k) {
            set_sync(m, skip, k + 1 == kMicro);
            auto out = m.root->forward(x.narrow(0, k * n, n));
            (torch::mse_loss(out, y.narrow(0, k * n, n)) / kMicro).backward();
          }
          opt->step();
        }
        auto state = m.root->full_state_dict();
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = state;
      },
      cohort::testing::options_for(c));
  return got;
}

class FSDPUnitGradientSync : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(FSDPUnitGradientSync, SomeUnitsAccumulatingLocallyEqualOneProcess) {
  const auto b = make_batches(13);
  const auto want = reference(b);
  for (auto skip :
       {Skip::kMiddleRecurse, Skip::kMiddleAlone, Skip::kRootAlone, Skip::kRootRecurse}) {
    SCOPED_TRACE("case " + std::to_string(static_cast<int>(skip)));
    for (const auto& [rank, state] : accumulate(GetParam(), b, skip)) {
      expect_close(state, want, 1e-6, "rank " + std::to_string(rank));
    }
  }
}

TEST_P(FSDPUnitGradientSync, ARankDependentSettingIsRefusedOnEveryRank) {
  const int world = GetParam().world;
  if (world == 1) GTEST_SKIP() << "needs other ranks";
  auto o = cohort::testing::options_for(GetParam());
  o.timeout = std::chrono::seconds(5);
  const auto errors = cohort::testing::errors_on_every_rank(
      world,
      [&](std::shared_ptr<Communicator> comm) {
        auto m = make(comm);
        m.middle->set_requires_gradient_sync(comm->rank() != 0, /*recurse=*/false);
        m.root->forward(torch::ones({2, 5})).sum().backward();
      },
      o);
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find("set_requires_gradient_sync"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("unit '2'"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

// The middle unit set by the user to keep its gradients local (recurse
// false), and a step of two micro-batches driven as the Trainer drives it:
// skip_sync() around the first. When its guard goes, every unit's flag is
// the user's again, so the middle's full gradients stay local through the
// last micro-batch too: its .grad is the sum of this rank's micro-batches'
// gradients, as one process computes it on the rank's rows, while the root
// and the inner unit synchronized.
TEST_P(FSDPUnitGradientSync, TheTrainersSkipSyncLeavesEachUnitsOwnFlag) {
  const auto c = GetParam();
  const auto b = make_batches(17);
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto m = make(comm);
        auto twin = make(nullptr);
        init_parameters(*twin.seq, 4);
        load_from(m.root, *twin.seq);
        m.middle->set_requires_gradient_sync(false, /*recurse=*/false);
        FSDPGradientSync sync(m.root);
        auto x = local(b.x[0], *comm), y = local(b.y[0], *comm);
        const int64_t n = x.size(0) / kMicro;
        for (int k = 0; k < kMicro; ++k) {
          auto guard = k + 1 < kMicro ? sync.skip_sync() : nullptr;
          const auto xk = x.narrow(0, k * n, n), yk = y.narrow(0, k * n, n);
          (torch::mse_loss(m.root->forward(xk), yk) / kMicro).backward();
          (torch::mse_loss(twin.seq->forward(xk), yk) / kMicro).backward();
        }
        for (const auto& module : m.root->modules()) {
          auto* unit = dynamic_cast<FullyShardImpl*>(module.get());
          if (unit) {
            EXPECT_EQ(unit->requires_gradient_sync(), unit != m.middle.get());
          }
        }
        const auto want = twin.seq->named_parameters();
        for (const auto& p : m.root->named_parameters()) {
          if (p.key().rfind("2.b.", 0) != 0) continue;
          const auto& g = p.value().grad();
          ASSERT_TRUE(g.defined()) << p.key();
          ASSERT_EQ(g.sizes(), want[p.key()].sizes()) << p.key() << " was reduce-scattered";
          EXPECT_TRUE(torch::allclose(g, want[p.key()].grad(), 1e-5, 1e-6)) << p.key();
        }
        // Such a step cannot be taken: the Trainer's finish_sync says which
        // unit, on every rank (the flags agree), before any optimizer step.
        try {
          sync.finish_sync();
          ADD_FAILURE() << "finish_sync accepted a unit whose gradients stayed local";
        } catch (const InvalidArgument& e) {
          EXPECT_NE(std::string(e.what()).find("set_requires_gradient_sync(false)"),
                    std::string::npos)
              << e.what();
        }
        m.middle->set_requires_gradient_sync(true, /*recurse=*/false);
        EXPECT_NO_THROW(sync.finish_sync());
      },
      cohort::testing::options_for(c));
}

// Each parameter's .grad on this rank is its rows of `twin`'s (one process):
// the rows ShardLayout gives the rank, ceil(rows / world) per rank.
void expect_gradient_rows(FullyShard& root, torch::nn::Module& twin, const Communicator& comm,
                          const std::string& what) {
  const auto want = twin.named_parameters();
  for (const auto& p : root->named_parameters()) {
    const auto& w = want[p.key()].grad();
    const auto& g = p.value().grad();
    ASSERT_EQ(g.defined(), w.defined()) << what << ": " << p.key();
    if (!w.defined()) continue;
    const int64_t rows = w.size(0), chunk = (rows + comm.size() - 1) / comm.size();
    const auto mine = w.narrow(0, std::min(rows, comm.rank() * chunk), g.size(0));
    const double err = g.numel() ? (g - mine).abs().max().item<double>() : 0.0;
    EXPECT_TRUE(torch::allclose(g, mine, 1e-5, 1e-6))
        << what << ": " << p.key() << " differs by " << err << " (largest "
        << w.abs().max().item<double>() << ")";
  }
}

// How the gradients are zeroed between a backward without sync and the
// next one: not at all (the accumulation goes on), set to none, or zeroed
// in place (Module::zero_grad's two forms; an optimizer's zero_grad is one
// of them).
enum class Zeroing { kNone, kSetToNone, kInPlace };

// A synchronizing backward leaves each unit's gradient shard in .grad (no
// zero_grad after it); a backward without sync puts that shard aside and
// accumulates the full gradient in .grad, where one process's .grad holds
// both. Then zero_grad, or not, and a synchronizing backward: every rank's
// .grad is its rows of one process's after the same three backwards and
// the same zeroing, on this rank's rows of each batch.
TEST_P(FSDPUnitGradientSync, AGradientShardPutAsideForABackwardWithoutSyncGoesWithZeroGrad) {
  const auto c = GetParam();
  const auto b = make_batches(19);
  for (auto zeroing : {Zeroing::kNone, Zeroing::kSetToNone, Zeroing::kInPlace}) {
    const std::string what = zeroing == Zeroing::kNone        ? "accumulating on"
                             : zeroing == Zeroing::kSetToNone ? "zero_grad(set_to_none)"
                                                              : "zero_grad in place";
    cohort::testing::run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          auto m = make(comm);
          auto twin = make(nullptr);
          init_parameters(*twin.seq, 4);
          load_from(m.root, *twin.seq);
          for (int k = 0; k < 3; ++k) {
            if (k == 2 && zeroing != Zeroing::kNone) {
              m.root->zero_grad(zeroing == Zeroing::kSetToNone);
              twin.seq->zero_grad(zeroing == Zeroing::kSetToNone);
            }
            m.root->set_requires_gradient_sync(k != 1);
            torch::mse_loss(m.root->forward(local(b.x[k], *comm)), local(b.y[k], *comm)).backward();
            torch::mse_loss(twin.seq->forward(b.x[k]), b.y[k]).backward();
          }
          expect_gradient_rows(m.root, *twin.seq, *comm,
                               what + ", rank " + std::to_string(comm->rank()));
        },
        cohort::testing::options_for(c));
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPUnitGradientSync,
                         ::testing::ValuesIn(cohort::testing::engine_worlds()),
                         cohort::testing::engine_world_name);

}  // namespace
}  // namespace cohort::gradient_sync_test
