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
//                          Linear (the root's input needs no gradient);
//   side input Linear      the root's trainable Linear makes a tensor that
//                          a unit reads beside its input (the data, which
//                          needs no gradient), through a frozen Linear, as a
//                          decoder block reads the encoder's output: that
//                          Linear's backward (the tensor's gradient) comes
//                          after the unit's trainable gradients landed;
//   side input scale       the same through a frozen [3] scale, which its
//                          backward reads as the parameter itself (resharded
//                          at world 3, a [1] shard that broadcasts);
//   frozen unit twice      an all-frozen unit (a frozen Linear, tanh) called
//                          twice between the root's trainable Linears.
//
// After 10 AdamW steps every parameter equals the one-process model's
// within 1e-6 relative (the frozen ones unchanged). When a unit is
// resharded: frozen_schedule_test.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "support/engine_worlds.h"
#include "tests/fsdp/frozen_models.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::frozen_test {
namespace {

using namespace cohort::testing::fsdp_test;
using cohort::testing::EngineWorld;
using torch::nn::LayerNorm;
using torch::nn::LayerNormOptions;

constexpr int64_t kLeaves = 6;  // kBatch / kLeaves rows each

enum class Shape {
  kFrozenLinearFirst,
  kFrozenLayerNormFirst,
  kFrozenOuterUnit,
  kFrozenAfterInner,
  kSideInputLinear,
  kSideInputScale,
  kFrozenUnitTwice
};
constexpr Shape kShapes[] = {Shape::kFrozenLinearFirst, Shape::kFrozenLayerNormFirst,
                             Shape::kFrozenOuterUnit,   Shape::kFrozenAfterInner,
                             Shape::kSideInputLinear,   Shape::kSideInputScale,
                             Shape::kFrozenUnitTwice};

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
    case Shape::kSideInputLinear:
      return "side input Linear";
    case Shape::kSideInputScale:
      return "side input scale";
    case Shape::kFrozenUnitTwice:
      return "frozen unit twice";
  }
  return "";
}

// The model of `shape` (see the file comment); with `comm` its units are
// made over it (the root is the caller's), else it is plain. Parameters
// are frozen before they are wrapped.
Sequential build(Shape shape, const std::shared_ptr<Communicator>& comm,
                 const FullyShardOptions& options) {
  // `block` as a unit, or plain.
  auto unit = [&](AnyModule block) {
    return comm ? AnyModule(FullyShard(block, comm, options)) : block;
  };
  // `block` as a unit of `into`, or as a plain layer of it.
  auto add_unit = [&](auto& into, AnyModule block) { into->push_back(unit(std::move(block))); };
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
    case Shape::kSideInputLinear:
    case Shape::kSideInputScale: {
      const bool scale = shape == Shape::kSideInputScale;
      auto slot = std::make_shared<torch::Tensor>();
      seq->push_back(
          SideInput(Linear(5, scale ? 3 : 6), unit(AnyModule(SideReader(slot, scale))), slot));
      break;
    }
    case Shape::kFrozenUnitTwice: {
      seq->push_back(Linear(5, 6));
      seq->push_back(Tanh());
      Stack block;
      block->add(frozen(Linear(6, 6)));
      block->add(Tanh());
      seq->push_back(Twice(unit(AnyModule(block))));
      seq->push_back(Linear(6, 5));
      break;
    }
  }
  return seq;
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
  return parameters_of(*model);
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
  for (auto shape : kShapes) {
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

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPFrozenLayers,
                         ::testing::ValuesIn(cohort::testing::engine_worlds()),
                         cohort::testing::engine_world_name);

}  // namespace
}  // namespace cohort::frozen_test
