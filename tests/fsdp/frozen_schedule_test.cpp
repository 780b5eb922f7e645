// When fully_shard reshards a unit with a frozen parameter: once that unit's
// backward is over, not at its last gradient (too early: a frozen layer
// still reads its weight) and not at the end of backward (a LoRA model's
// units would all stay gathered); and what its gradients hold: only the
// trainable parameters' rows. Ranks as threads over Gloo at worlds 1 and
// 3; gathered units and held bytes are counted from gradient hooks, which
// run in the middle of backward. frozen_test.cpp checks the numbers of
// these models' kind against one process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "cohort/memory/memory_scope.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/frozen_models.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::frozen_schedule_test {
namespace {

using namespace cohort::testing::fsdp_test;

constexpr int64_t kWidth = 8;

int gathered(const std::vector<FullyShard>& units) {
  int n = 0;
  for (const auto& u : units) n += u->param_group().is_unsharded() ? 1 : 0;
  return n;
}

// A unit with a frozen layer is resharded once its input's gradient is
// complete, not at the end of backward: in a LoRA-like stack of six units
// (a frozen Linear, tanh, a trainable Linear) behind the root's trainable
// Linear, when a unit's trainable weight gets its gradient at most two
// units are gathered (that one and the one prefetched after it), and when
// the root's Linear gets its gradient none is. Kept gathered to the end of
// backward, all six would be.
TEST(FSDPFrozenLayersSchedule, AUnitWithAFrozenLayerIsReshardedWhenItsBackwardEnds) {
  constexpr int64_t kBlocks = 6;
  for (int world : {1, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    cohort::testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      Sequential seq;
      Linear first(kWidth, kWidth);
      seq->push_back(first);
      std::vector<FullyShard> blocks;
      std::vector<Linear> trainable;
      for (int64_t i = 0; i < kBlocks; ++i) {
        Stack block;
        block->add(frozen(Linear(kWidth, kWidth)));
        block->add(Tanh());
        trainable.push_back(Linear(kWidth, kWidth));
        block->add(trainable.back());
        blocks.push_back(FullyShard(AnyModule(block), comm));
        seq->push_back(blocks.back());
      }
      auto model = fully_shard(seq, comm);
      int most = 0, at_first = -1;
      for (auto& l : trainable) {
        l->weight.register_hook(
            [&](const torch::Tensor&) { most = std::max(most, gathered(blocks)); });
      }
      first->weight.register_hook([&](const torch::Tensor&) { at_first = gathered(blocks); });
      model->forward(torch::randn({2, kWidth})).sum().backward();
      EXPECT_GE(most, 1);  // the hooks ran while a unit computed
      EXPECT_LE(most, 2);
      EXPECT_EQ(at_first, 0);
    });
  }
}

// A decoder's blocks each read the encoder's output beside their input,
// through a frozen Linear: a block is resharded once that Linear's backward
// ran too, before the encoder's gradient is complete. Four blocks (the
// first one's input is the data) after the root's encoder Linear: at most
// two are gathered when a block's trainable weight gets its gradient, none
// when the encoder's does.
struct DecoderImpl : torch::nn::Module {
  Linear enc{nullptr};
  std::vector<AnyModule> blocks;
  Slot slot = std::make_shared<torch::Tensor>();
  torch::Tensor forward(torch::Tensor x) {
    *slot = enc(x);
    for (auto& b : blocks) x = torch::tanh(b.forward<torch::Tensor>(x));
    *slot = torch::Tensor();
    return x;
  }
};
TORCH_MODULE(Decoder);

TEST(FSDPFrozenLayersSchedule, ABlockReadingASideInputIsReshardedWhenItsFrozenLayersBackwardRan) {
  for (int world : {1, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    cohort::testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      Decoder dec;
      dec->enc = dec->register_module("enc", Linear(5, 6));
      std::vector<FullyShard> units;
      std::vector<Linear> trainable;
      for (int i = 0; i < 4; ++i) {
        SideReader block(dec->slot, /*scale=*/false);
        trainable.push_back(block->out);
        units.push_back(FullyShard(AnyModule(block), comm));
        dec->blocks.emplace_back(dec->register_module(std::to_string(i), units.back()));
      }
      auto model = fully_shard(AnyModule(dec), comm);
      int most = 0, at_enc = -1;
      for (auto& l : trainable) {
        l->weight.register_hook(
            [&](const torch::Tensor&) { most = std::max(most, gathered(units)); });
      }
      dec->enc->weight.register_hook([&](const torch::Tensor&) { at_enc = gathered(units); });
      model->forward(torch::randn({2, 5})).sum().backward();
      EXPECT_GE(most, 1);
      EXPECT_LE(most, 2);
      EXPECT_EQ(at_enc, 0);
    });
  }
}

// The root's trainable Linear, an all-frozen unit (a frozen Linear, tanh),
// a unit of a frozen Linear, tanh and a trainable Linear, the root's
// trainable Linear. `twice`: the all-frozen unit is called twice.
struct FrozenChain {
  Sequential seq;
  Linear first{kWidth, kWidth};
  std::vector<FullyShard> units;
};

FrozenChain frozen_chain(const std::shared_ptr<Communicator>& comm, bool twice) {
  FrozenChain c;
  auto unit = [&](AnyModule m) -> AnyModule {
    if (!comm) return m;
    c.units.push_back(FullyShard(m, comm));
    return AnyModule(c.units.back());
  };
  c.seq->push_back(c.first);
  c.seq->push_back(Tanh());
  Stack all_frozen;
  all_frozen->add(frozen(Linear(kWidth, kWidth)));
  all_frozen->add(Tanh());
  if (twice) {
    c.seq->push_back(Twice(unit(AnyModule(all_frozen))));
  } else {
    c.seq->push_back(unit(AnyModule(all_frozen)));
  }
  Stack lora;
  lora->add(frozen(Linear(kWidth, kWidth)));
  lora->add(Tanh());
  lora->add(Linear(kWidth, kWidth));
  c.seq->push_back(unit(AnyModule(lora)));
  c.seq->push_back(Linear(kWidth, kWidth));
  return c;
}

// An all-frozen unit called twice is gathered for each call's backward and
// resharded after each: none of the units is gathered when the root's first
// Linear gets its gradient.
TEST(FSDPFrozenLayersSchedule, AFrozenUnitCalledTwiceIsReshardedAfterItsSecondBackward) {
  for (int world : {1, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    cohort::testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      auto c = frozen_chain(comm, /*twice=*/true);
      auto model = fully_shard(c.seq, comm);
      int at_first = -1;
      c.first->weight.register_hook([&](const torch::Tensor&) { at_first = gathered(c.units); });
      model->forward(torch::randn({2, kWidth})).sum().backward();
      EXPECT_EQ(at_first, 0);
    });
  }
}

// A second backward through a kept graph (retain_graph) runs every unit's
// backward again: none is gathered when the root's first Linear gets its
// gradient, and after 4 AdamW steps of two backwards each the parameters
// equal one process's within 1e-6 relative. (Not with leaves: a leaf is one
// forward and one backward.)
TEST(FSDPFrozenLayersSchedule,
     ASecondBackwardThroughAKeptGraphReshardsEachUnitWhenItsBackwardEnds) {
  constexpr int kRetainedSteps = 4;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  std::vector<torch::Tensor> xs;
  for (int s = 0; s < kRetainedSteps; ++s) xs.push_back(torch::randn({6, kWidth}, gen));
  auto train = [&](FrozenChain& c, torch::nn::Module& model, const Communicator* comm,
                   const std::function<torch::Tensor(const torch::Tensor&)>& forward) {
    auto opt = make_optimizer(Opt::AdamW, model.parameters());
    std::vector<int> at_first;
    c.first->weight.register_hook(
        [&](const torch::Tensor&) { at_first.push_back(gathered(c.units)); });
    for (int s = 0; s < kRetainedSteps; ++s) {
      opt->zero_grad();
      auto x = comm ? local(xs[s], *comm) : xs[s];
      auto loss = forward(x).pow(2).mean();
      loss.backward({}, /*retain_graph=*/true);
      (loss * 0.5).backward();
      opt->step();
    }
    return at_first;
  };
  auto plain = frozen_chain(nullptr, /*twice=*/false);
  init_parameters(*plain.seq, 5);
  train(plain, *plain.seq, nullptr, [&](const torch::Tensor& x) { return plain.seq->forward(x); });
  Named want;
  for (const auto& p : plain.seq->named_parameters()) want.insert(p.key(), p.value().detach());
  for (int world : {1, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::mutex mu;
    std::map<int, Named> got;
    cohort::testing::run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      auto c = frozen_chain(comm, /*twice=*/false);
      auto model = fully_shard(c.seq, comm);
      auto twin = frozen_chain(nullptr, /*twice=*/false);
      init_parameters(*twin.seq, 5);
      load_from(model, *twin.seq);
      const auto at_first =
          train(c, *model, comm.get(), [&](const torch::Tensor& x) { return model->forward(x); });
      EXPECT_EQ(at_first, std::vector<int>(2 * kRetainedSteps, 0));
      auto state = model->full_state_dict();
      std::lock_guard<std::mutex> lock(mu);
      got[comm->rank()] = std::move(state);
    });
    for (const auto& [rank, state] : got) {
      expect_close(state, want, 1e-6, "rank " + std::to_string(rank));
    }
  }
}

// A LoRA-like unit's gradient shard holds its trainable parameters' rows
// only, during backward and after it: the frozen weight's rows of the
// reduce-scatter's output (nearly the whole unit) go as soon as it is done.
// Eight units of a frozen Linear(32, 32), tanh and a rank-2 pair of
// bias-free Linears, behind the root's Linear(32, 32), on 2 rows a rank,
// counting what backward allocates on the rank's thread: after backward
// (its transient buffers gone) it holds every unit's trainable rows and the
// root's gradient shard (within 1 KiB), and the storages behind a unit's
// .grad are exactly its trainable rows (with leaves too, 3 in all: the
// storages). Kept whole, the eight frozen weights' rows exceed it. What it
// holds during backward depends on how far the communication thread lags,
// so it is not bounded here. The ranks run
// cohort's ring algorithms (as FSDPFeatures' memory test): Gloo's own
// collectives stage copies on the rank's thread that the engine keeps.
TEST(FSDPFrozenLayersMemory, AUnitsGradientShardHoldsOnlyItsTrainableRows) {
  constexpr int64_t kWide = 32, kRank = 2, kUnits = 8, kRows = 2, kLeafCount = 3;
  cohort::testing::ThreadRanksOptions ring;
  ring.algorithm = Algorithm::Ring;
  for (bool leaves : {false, true}) {
    for (int world : {1, 3}) {
      SCOPED_TRACE(std::string(leaves ? "leaves, " : "") + "world " + std::to_string(world));
      cohort::testing::run_ranks_shared(
          world,
          [&](std::shared_ptr<Communicator> comm) {
            torch::set_num_threads(1);
            FullyShardOptions options;
            if (leaves) {
              options.determinism = Determinism::WorldSizeInvariant;
              options.leaves = kLeafCount;
            }
            Sequential seq;
            Linear first(kWide, kWide);
            seq->push_back(first);
            std::vector<FullyShard> units;
            for (int64_t i = 0; i < kUnits; ++i) {
              Stack block;
              block->add(frozen(Linear(kWide, kWide)));
              block->add(Tanh());
              block->add(Linear(torch::nn::LinearOptions(kWide, kRank).bias(false)));
              block->add(Linear(torch::nn::LinearOptions(kRank, kWide).bias(false)));
              units.push_back(FullyShard(AnyModule(block), comm, options));
              seq->push_back(units.back());
            }
            auto model = fully_shard(seq, comm, options);
            // Bytes of unit u's trainable parameters' rows on this rank.
            auto trainable_bytes = [&](const FullyShard& u) {
              const auto& g = u->param_group();
              int64_t n = 0;
              for (size_t i = 0; i < g.params().size(); ++i) {
                const auto& p = g.layout().params[i];
                if (g.params()[i].requires_grad()) n += p.local_rows * p.row_numel * 4;
              }
              return n;
            };
            int64_t all_trainable = 0;
            for (const auto& u : units) all_trainable += trainable_bytes(u);
            memory::MemoryScope scope;
            if (leaves) {
              for (int64_t k = 0; k < model->local_leaves(); ++k) {
                model->forward(torch::randn({kRows, kWide})).sum().backward();
              }
            } else {
              model->forward(torch::randn({kRows, kWide})).sum().backward();
              // 1 KiB for the library's own small tensors (LibTorch 2.6
              // keeps 136 bytes more here than 1.13); the whole outputs of
              // the frozen weights' rows would be many KiB more.
              const int64_t kept = all_trainable + model->param_group().layout().shard_numel * 4;
              EXPECT_GE(scope.current_bytes(), kept);
              EXPECT_LE(scope.current_bytes(), kept + 1024);
            }
            for (const auto& u : units) {
              std::set<const c10::StorageImpl*> seen;
              int64_t held = 0;
              for (const auto& p : u->param_group().params()) {
                if (!p.grad().defined()) continue;
                if (seen.insert(p.grad().storage().unsafeGetStorageImpl()).second) {
                  held += static_cast<int64_t>(p.grad().storage().nbytes());
                }
              }
              EXPECT_EQ(held, trainable_bytes(u));
            }
          },
          ring);
    }
  }
}

}  // namespace
}  // namespace cohort::frozen_schedule_test
