// fully_shard with frozen layers whose weights backward still reads
// (LoRA, partial fine-tuning), ranks as threads over Gloo and UCX at world
// 1 to 3, with and without leaves (Determinism::WorldSizeInvariant). A
// frozen layer gets no gradient, so the unit's last gradient may land
// before that layer's backward has run; the unit must stay gathered until
// then. The models:
//
//   frozen Linear first    a trainable Linear (the root's), then a unit of
//                          a frozen Linear, tanh and a trainable Linear: the
//                          unit's input needs a gradient, so the frozen
//                          Linear's backward (its input's gradient, from its
//                          weight) runs after the trainable Linear's
//                          gradients landed;
//   frozen LayerNorm first the same with a frozen LayerNorm;
//   frozen outer unit      the root's trainable Linear, then an all-frozen
//                          unit: a frozen Linear, tanh and a unit around a
//                          trainable Linear;
//   frozen after inner     the root holds a unit around a trainable Linear,
//                          then a frozen Linear, then its own trainable
//                          Linear (the root's input needs no gradient).
//
// After 10 AdamW steps every parameter equals the one-process model's
// within 1e-6 relative (the frozen ones unchanged). And such a unit is
// resharded when its backward ends, not kept to the end of backward: a
// LoRA-like stack holds at most two units gathered.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::frozen_test {
namespace {

using namespace cohort::testing::fsdp_test;
using cohort::testing::EngineWorld;
using torch::nn::LayerNorm;
using torch::nn::LayerNormOptions;

constexpr int64_t kLeaves = 6;  // kBatch / kLeaves rows each

enum class Shape { kFrozenLinearFirst, kFrozenLayerNormFirst, kFrozenOuterUnit, kFrozenAfterInner };

std::string name_of(Shape s) {
  switch (s) {
    case Shape::kFrozenLinearFirst:
      return "frozen Linear first";
    case Shape::kFrozenLayerNormFirst:
      return "frozen LayerNorm first";
    case Shape::kFrozenOuterUnit:
      return "frozen outer unit";
    case Shape::kFrozenAfterInner:
      return "frozen after inner";
  }
  return "";
}

template <class M>
M frozen(M m) {
  for (auto& p : m->parameters()) p.set_requires_grad(false);
  return m;
}

// Layers in order, named "0", "1", ... as in a Sequential (which an
// AnyModule cannot hold, so one cannot sit in another plainly).
struct StackImpl : torch::nn::Module {
  std::vector<AnyModule> layers;
  template <class M>
  void add(M m) {
    layers.emplace_back(register_module(std::to_string(layers.size()), m));
  }
  void push_back(AnyModule m) { add(std::move(m)); }
  void add(AnyModule m) {
    register_module(std::to_string(layers.size()), m.ptr());
    layers.push_back(std::move(m));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = l.forward<torch::Tensor>(x);
    return x;
  }
};
TORCH_MODULE(Stack);

// The model of `shape` (see the file comment); with `comm` its units are
// made over it (the root is the caller's), else it is plain. Parameters
// are frozen before they are wrapped.
Sequential build(Shape shape, const std::shared_ptr<Communicator>& comm,
                 const FullyShardOptions& options) {
  // `block` as a unit of `into`, or as a plain layer of it.
  auto add_unit = [&](auto& into, AnyModule block) {
    if (comm) {
      into->push_back(AnyModule(FullyShard(block, comm, options)));
    } else {
      into->push_back(std::move(block));
    }
  };
  Sequential seq;
  switch (shape) {
    case Shape::kFrozenLinearFirst:
    case Shape::kFrozenLayerNormFirst: {
      seq->push_back(Linear(5, 6));
      seq->push_back(Tanh());
      Stack block;
      if (shape == Shape::kFrozenLinearFirst) {
        block->add(frozen(Linear(6, 6)));
      } else {
        block->add(frozen(LayerNorm(LayerNormOptions({6}))));
      }
      block->add(Tanh());
      block->add(Linear(6, 5));
      add_unit(seq, AnyModule(block));
      break;
    }
    case Shape::kFrozenOuterUnit: {
      seq->push_back(Linear(5, 6));
      seq->push_back(Tanh());
      Stack outer;
      outer->add(frozen(Linear(6, 6)));
      outer->add(Tanh());
      add_unit(outer, AnyModule(Linear(6, 5)));
      add_unit(seq, AnyModule(outer));
      break;
    }
    case Shape::kFrozenAfterInner:
      add_unit(seq, AnyModule(Linear(5, 6)));
      seq->push_back(Tanh());
      seq->push_back(frozen(Linear(6, 6)));
      seq->push_back(Tanh());
      seq->push_back(Linear(6, 5));
      break;
  }
  return seq;
}

Named values_of(torch::nn::Module& m) {
  Named out;
  for (const auto& p : m.named_parameters()) out.insert(p.key(), p.value().detach().clone());
  return out;
}

Named reference(Shape shape, const Batches& b) {
  auto model = build(shape, nullptr, {});
  init_parameters(*model, 3);
  auto opt = make_optimizer(Opt::AdamW, model->parameters());
  for (int s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    torch::mse_loss(model->forward(b.x[s]), b.y[s]).backward();
    opt->step();
  }
  return values_of(*model);
}

// Every rank's gathered model after kSteps steps on its rows of each batch;
// `leaves`: with Determinism::WorldSizeInvariant over kLeaves leaves.
std::map<int, Named> sharded(Shape shape, const EngineWorld& c, const Batches& b, bool leaves) {
  std::mutex mu;
  std::map<int, Named> got;
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        FullyShardOptions options;
        if (leaves) {
          options.determinism = Determinism::WorldSizeInvariant;
          options.leaves = kLeaves;
        }
        auto model = fully_shard(build(shape, comm, options), comm, options);
        auto twin = build(shape, nullptr, {});
        init_parameters(*twin, 3);
        load_from(model, *twin);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        for (int s = 0; s < kSteps; ++s) {
          opt->zero_grad();
          if (!leaves) {
            auto out = model->forward(local(b.x[s], *comm));
            torch::mse_loss(out, local(b.y[s], *comm)).backward();
          }
          const int64_t rows = kBatch / kLeaves;
          for (int64_t k = 0; leaves && k < model->local_leaves(); ++k) {
            const int64_t from = (model->first_leaf() + k) * rows;
            auto out = model->forward(b.x[s].narrow(0, from, rows));
            torch::mse_loss(out, b.y[s].narrow(0, from, rows)).backward();
          }
          opt->step();
        }
        auto state = model->full_state_dict();
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = std::move(state);
      },
      cohort::testing::options_for(c));
  return got;
}

void expect_one_process(const EngineWorld& c, bool leaves) {
  const auto b = make_batches(23);
  for (auto shape : {Shape::kFrozenLinearFirst, Shape::kFrozenLayerNormFirst,
                     Shape::kFrozenOuterUnit, Shape::kFrozenAfterInner}) {
    SCOPED_TRACE(name_of(shape));
    const auto want = reference(shape, b);
    std::map<int, Named> got;
    try {
      got = sharded(shape, c, b, leaves);
    } catch (const std::exception& e) {
      // The other shapes still run.
      const std::string what = e.what();
      ADD_FAILURE() << "training threw: " << what.substr(0, what.find('\n'));
    }
    for (const auto& [rank, state] : got) {
      expect_close(state, want, 1e-6, "rank " + std::to_string(rank));
    }
  }
}

class FSDPFrozenLayers : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(FSDPFrozenLayers, AUnitStaysGatheredUntilItsFrozenLayersBackwardRan) {
  expect_one_process(GetParam(), /*leaves=*/false);
}

TEST_P(FSDPFrozenLayers, WithLeavesAUnitStaysGatheredUntilItsFrozenLayersBackwardRan) {
  expect_one_process(GetParam(), /*leaves=*/true);
}

// A unit with a frozen layer is resharded once its input's gradient is
// complete, not at the end of backward: in a LoRA-like stack of six units
// (a frozen Linear, tanh, a trainable Linear) behind the root's trainable
// Linear, when a unit's trainable weight gets its gradient at most two
// units are gathered (that one and the one prefetched after it), and when
// the root's Linear gets its gradient none is. Kept gathered to the end of
// backward, all six would be.
TEST(FSDPFrozenLayersSchedule, AUnitWithAFrozenLayerIsReshardedWhenItsBackwardEnds) {
  constexpr int64_t kWidth = 8, kBlocks = 6;
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
      auto gathered = [&] {
        int n = 0;
        for (auto& b : blocks) n += b->param_group().is_unsharded() ? 1 : 0;
        return n;
      };
      int most = 0, at_first = -1;
      for (auto& l : trainable) {
        l->weight.register_hook([&](const torch::Tensor&) { most = std::max(most, gathered()); });
      }
      first->weight.register_hook([&](const torch::Tensor&) { at_first = gathered(); });
      model->forward(torch::randn({2, kWidth})).sum().backward();
      EXPECT_GE(most, 1);  // the hooks ran while a unit computed
      EXPECT_LE(most, 2);
      EXPECT_EQ(at_first, 0);
    });
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPFrozenLayers,
                         ::testing::ValuesIn(cohort::testing::engine_worlds()),
                         cohort::testing::engine_world_name);

}  // namespace
}  // namespace cohort::frozen_test
