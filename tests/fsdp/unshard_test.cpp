// A unit inside a fully sharded model (not its root), ranks as threads over
// Gloo and UCX at world 1 to 3: unshard(), reshard(), full_state_dict() and
// load_full_state_dict() act on that unit alone, before or after the model's
// first forward, between steps or between a forward and its backward;
// clip_grad_norm() is an InvalidArgument naming the method and the root, and
// set_requires_gradient_sync(true) on it changes nothing (its sync:
// gradient_sync_test.cpp). Either way the model then trains as one
// process does (10 AdamW steps, every parameter within 1e-6 relative): the
// root's schedule is untouched.
//
// hpZ (reshard_after_forward = N, world 4 and 6): after a forward under
// NoGradGuard kept its spans and an optimizer step changed the shards,
// unshard() of the root or of a unit gathers the shards as they are now
// (bitwise the post-step shards gathered by full_state_dict).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "cohort/fsdp/fully_shard.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::unshard_test {
namespace {

using namespace fsdp_test;

struct Case {
  std::string backend;
  int world;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return info.param.backend + "_world" + std::to_string(info.param.world);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& b : thread_backends()) {
    for (int w : {1, 2, 3}) out.push_back({b, w});
  }
  return out;
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.backend << " world " << c.world; }

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

ThreadRanksOptions options_for(const std::string& backend) {
  ThreadRanksOptions o;
  o.backend = backend;
  return o;
}

// When the call on the inner unit is made.
enum class When {
  kBeforeFirstForward,   // after wrapping, before any forward
  kBetweenSteps,         // after step 0's optimizer step
  kForwardThenBackward,  // in step 1, between the forward and its backward
};

// What is called on the unit '2' (a Linear(7, 6)) of the model; `root` is
// the model's root.
using Call = std::function<void(FullyShardImpl& unit, FullyShard& root)>;

// kSteps AdamW steps with `call` made on the unit at `when`; each rank's
// gathered model.
std::map<int, Named> train_calling(const Case& c, const Batches& b, When when, const Call& call) {
  std::mutex mu;
  std::map<int, Named> got;
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto seq = make_model(comm, {});
        auto model = fully_shard(seq, comm);
        auto twin = make_model(nullptr, {});
        init_parameters(*twin, 7);
        load_from(model, *twin);
        auto unit = seq->ptr<FullyShardImpl>(2);
        if (when == When::kBeforeFirstForward) call(*unit, model);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        for (int s = 0; s < kSteps; ++s) {
          opt->zero_grad();
          auto loss = torch::mse_loss(model->forward(local(b.x[s], *comm)), local(b.y[s], *comm));
          if (s == 1 && when == When::kForwardThenBackward) call(*unit, model);
          loss.backward();
          opt->step();
          if (s == 0 && when == When::kBetweenSteps) call(*unit, model);
        }
        auto state = model->full_state_dict();
        std::lock_guard<std::mutex> lock(mu);
        got[comm->rank()] = state;
      },
      options_for(c.backend));
  return got;
}

void expect_one_process(const Case& c, When when, const Call& call) {
  const auto b = make_batches(9);
  const auto expected = reference(Opt::AdamW, b);
  for (const auto& [rank, state] : train_calling(c, b, when, call)) {
    expect_close(state, expected, 1e-6, "rank " + std::to_string(rank));
  }
}

// `call` throws an InvalidArgument naming `method` and the root.
void expect_root_only(const std::function<void()>& call, const std::string& method) {
  try {
    call();
    ADD_FAILURE() << method << " on an inner unit did not throw";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_TRUE(has(what, method + " on the unit around torch::nn::Linear")) << what;
    EXPECT_TRUE(has(what, "call " + method + " on the root")) << what;
  }
}

void unshard_and_check(FullyShardImpl& unit) {
  unit.unshard();
  // The unit's full parameters: Linear(7, 6).
  EXPECT_EQ(unit.named_parameters()["weight"].sizes(), (std::vector<int64_t>{6, 7}));
  EXPECT_EQ(unit.named_parameters()["bias"].sizes(), (std::vector<int64_t>{6}));
}

class FSDPInnerUnit : public ::testing::TestWithParam<Case> {};

TEST_P(FSDPInnerUnit, UnshardBetweenStepsTrainsAsOneProcess) {
  expect_one_process(GetParam(), When::kBetweenSteps,
                     [](FullyShardImpl& unit, FullyShard&) { unshard_and_check(unit); });
}

TEST_P(FSDPInnerUnit, UnshardBeforeTheFirstForwardTrainsAsOneProcess) {
  expect_one_process(GetParam(), When::kBeforeFirstForward,
                     [](FullyShardImpl& unit, FullyShard&) { unshard_and_check(unit); });
}

TEST_P(FSDPInnerUnit, UnshardBetweenForwardAndBackwardTrainsAsOneProcess) {
  expect_one_process(GetParam(), When::kForwardThenBackward,
                     [](FullyShardImpl& unit, FullyShard&) { unshard_and_check(unit); });
}

TEST_P(FSDPInnerUnit, UnshardThenReshardTrainsAsOneProcess) {
  for (auto when : {When::kBeforeFirstForward, When::kBetweenSteps}) {
    expect_one_process(GetParam(), when, [](FullyShardImpl& unit, FullyShard&) {
      unit.unshard();
      unit.reshard();
      EXPECT_EQ(unit.param_group().is_unsharded(), false);
    });
  }
}

TEST_P(FSDPInnerUnit, FullStateDictIsTheUnitsAndLoadsBack) {
  for (auto when : {When::kBeforeFirstForward, When::kBetweenSteps}) {
    expect_one_process(GetParam(), when, [](FullyShardImpl& unit, FullyShard& root) {
      const auto mine = unit.full_state_dict();
      const auto whole = root->full_state_dict();
      ASSERT_EQ(mine.size(), 2u);
      EXPECT_TRUE(torch::equal(mine["weight"], whole["2.weight"]));
      EXPECT_TRUE(torch::equal(mine["bias"], whole["2.bias"]));
      unit.load_full_state_dict(mine);
    });
  }
}

TEST_P(FSDPInnerUnit, SetRequiresGradientSyncTrueChangesNothing) {
  for (auto when : {When::kBeforeFirstForward, When::kBetweenSteps, When::kForwardThenBackward}) {
    expect_one_process(GetParam(), when, [](FullyShardImpl& unit, FullyShard&) {
      unit.set_requires_gradient_sync(true);
    });
  }
}

TEST_P(FSDPInnerUnit, ClipGradNormIsRefusedAndChangesNothing) {
  for (auto when : {When::kBeforeFirstForward, When::kBetweenSteps}) {
    expect_one_process(GetParam(), when, [](FullyShardImpl& unit, FullyShard&) {
      expect_root_only([&] { unit.clip_grad_norm(1.0); }, "clip_grad_norm");
    });
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPInnerUnit, ::testing::ValuesIn(cases()), case_name);

// hpZ: the shard group of `world` ranks, spans kept within groups of `n`.
struct HpzCase {
  std::string backend;
  int world, n;
  bool root;  // unshard() of the root, else of one unit
};

std::string hpz_name(const ::testing::TestParamInfo<HpzCase>& info) {
  const auto& c = info.param;
  return c.backend + "_world" + std::to_string(c.world) + "_n" + std::to_string(c.n) +
         (c.root ? "_root" : "_unit");
}

std::vector<HpzCase> hpz_cases() {
  std::vector<HpzCase> out;
  for (const auto& b : thread_backends()) {
    for (auto [w, n] : {std::pair{4, 2}, {6, 2}, {6, 3}}) {
      for (bool root : {true, false}) out.push_back({b, w, n, root});
    }
  }
  return out;
}

void PrintTo(const HpzCase& c, std::ostream* os) { *os << hpz_name({c, 0}); }

class FSDPHpzUnshard : public ::testing::TestWithParam<HpzCase> {};

TEST_P(FSDPHpzUnshard, GathersTheShardsAfterTheOptimizerStep) {
  const auto c = GetParam();
  const auto b = make_batches(12);
  run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        FullyShardOptions options;
        options.reshard_after_forward = c.n;
        // Every layer a unit: the root holds nothing, so the optimizer
        // steps shards only.
        auto blocks = shard_blocks(
            Sequential(Linear(5, 8), Tanh(), Linear(8, 12), Tanh(), Linear(12, 5)), comm, options);
        auto model = fully_shard(blocks, comm);
        auto opt = make_optimizer(Opt::AdamW, model->parameters());
        const auto x = local(b.x[0], *comm), y = local(b.y[0], *comm);
        torch::mse_loss(model->forward(x), y).backward();
        {
          // Keeps each unit's span (1/n of its full parameters).
          torch::NoGradGuard no_grad;
          model->forward(x);
        }
        opt->step();
        const auto unit = blocks->ptr<FullyShardImpl>(2);
        if (c.root) {
          model->unshard();
        } else {
          unit->unshard();
        }
        const auto gathered = model->full_state_dict();  // the shards as they are now
        int compared = 0;
        for (const auto& p : model->named_parameters()) {
          if (!c.root && p.key().rfind("2.", 0) != 0) continue;
          const auto& want = gathered[p.key()];
          ASSERT_EQ(p.value().sizes(), want.sizes()) << p.key();
          EXPECT_TRUE(torch::equal(p.value(), want))
              << "rank " << comm->rank() << ": " << p.key() << " differs by "
              << (p.value() - want).abs().max().item<double>();
          ++compared;
        }
        EXPECT_EQ(compared, c.root ? 6 : 2);
        model->reshard();
      },
      options_for(c.backend));
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPHpzUnshard, ::testing::ValuesIn(hpz_cases()), hpz_name);

}  // namespace
}  // namespace cohort::testing::unshard_test
