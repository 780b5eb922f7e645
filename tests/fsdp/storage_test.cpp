// fully_shard refuses a parameter whose storage was replaced after it was
// wrapped, instead of discarding the new values at its next all-gather:
// torch::load (which set_()s each tensor), Module::to(kFloat64) and
// set_data after a training step are an InvalidArgument at the next forward
// on every rank, naming the parameter and the way to load (ranks as threads
// over Gloo and UCX, world 1 to 3); so is one rank's replacement alone, a
// replacement while unsharded (at reshard()), and full_state_dict() after one.
// Loading through load_full_state_dict, an in-place copy into a parameter and
// Module::to of the dtype it already has keep working.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "cohort/fsdp/fully_shard.h"
#include "support/rank_errors.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::storage_test {
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

ThreadRanksOptions short_timeout(const Case& c) {
  ThreadRanksOptions o;
  o.backend = c.backend;
  o.timeout = std::chrono::seconds(5);
  return o;
}

// A model wrapped with fully_shard that has taken one training step, so that
// its root's schedule exists; `then` runs on it.
using Then = std::function<void(FullyShard&, Sequential&, const Communicator&)>;

std::vector<std::string> after_one_step(const Case& c, const Then& then) {
  const auto b = make_batches(3);
  return errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto seq = make_model(comm, {});
        auto model = fully_shard(seq, comm);
        auto twin = make_model(nullptr, {});
        init_parameters(*twin, 7);
        load_from(model, *twin);
        torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
        torch::mse_loss(model->forward(local(b.x[0], *comm)), local(b.y[0], *comm)).backward();
        opt.step();
        then(model, seq, *comm);
      },
      short_timeout(c));
}

void forward(FullyShard& model, const Communicator& comm) {
  model->forward(local(make_batches(4).x[0], comm));
}

// Every rank's error names the replaced parameter and how to load instead.
void expect_refused(const std::vector<std::string>& errors, const std::string& parameter) {
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    EXPECT_TRUE(has(e, "parameter '" + parameter + "'")) << "rank " << r << ": " << e;
    EXPECT_TRUE(has(e, "no longer holds the storage fully_shard gave it")) << e;
    EXPECT_TRUE(has(e, "load_full_state_dict")) << e;
    EXPECT_TRUE(has(e, "dcp::set_state_dict")) << e;
  }
}

class FSDPStorage : public ::testing::TestWithParam<Case> {};

TEST_P(FSDPStorage, TorchLoadAfterFullyShardIsRefusedAtTheNextForward) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("cohort-fsdp-storage-" + std::to_string(getpid()) + "-" + GetParam().backend);
  std::filesystem::create_directories(dir);
  auto errors =
      after_one_step(GetParam(), [&](FullyShard& model, Sequential&, const Communicator& comm) {
        const auto file = (dir / ("rank" + std::to_string(comm.rank()) + ".pt")).string();
        torch::save(model, file);
        torch::load(model, file);  // set_()s every parameter to the file's tensor
        forward(model, comm);
      });
  std::filesystem::remove_all(dir);
  // The root's own parameters come first: its tied weight.
  expect_refused(errors, "0.w");
}

TEST_P(FSDPStorage, ModuleToAnotherDtypeIsRefusedAtTheNextForward) {
  auto errors =
      after_one_step(GetParam(), [](FullyShard& model, Sequential&, const Communicator& comm) {
        model->to(torch::kFloat64);
        forward(model, comm);
      });
  expect_refused(errors, "0.w");
  for (const auto& e : errors) EXPECT_TRUE(has(e, "it is now float64")) << e;
}

TEST_P(FSDPStorage, SetDataOfAnInnerUnitsParameterIsRefusedAtTheNextForward) {
  auto errors =
      after_one_step(GetParam(), [](FullyShard& model, Sequential& seq, const Communicator& comm) {
        auto weight = seq->ptr<FullyShardImpl>(2)->named_parameters()["weight"];
        weight.set_data(weight.detach().clone());
        forward(model, comm);
      });
  expect_refused(errors, "weight");
  for (const auto& e : errors) EXPECT_TRUE(has(e, "unit '2'")) << e;
}

TEST_P(FSDPStorage, OneRanksReplacementIsRefusedOnEveryRank) {
  const int world = GetParam().world;
  if (world == 1) GTEST_SKIP() << "needs other ranks";
  auto errors = after_one_step(
      GetParam(), [world](FullyShard& model, Sequential& seq, const Communicator& comm) {
        if (comm.rank() == world - 1) {
          auto weight = seq->ptr<FullyShardImpl>(4)->named_parameters()["weight"];
          weight.set_data(weight.detach().clone());
        }
        forward(model, comm);
      });
  const std::string last = std::to_string(world - 1);
  for (int r = 0; r < world; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "on rank " + std::to_string(r))) << e;
    if (r == world - 1) {
      EXPECT_TRUE(has(e, "parameter 'weight'")) << e;
      EXPECT_TRUE(has(e, "unit '4'")) << e;
    } else {
      EXPECT_TRUE(has(e, "a rank cannot go on (its own error says why): ")) << e;
      EXPECT_TRUE(has(e, "rank " + last + ": refuses to go on")) << e;
    }
  }
}

TEST_P(FSDPStorage, ReplacingAnUnshardedParameterIsRefusedAtReshard) {
  auto errors =
      after_one_step(GetParam(), [](FullyShard& model, Sequential& seq, const Communicator&) {
        model->unshard();
        auto weight = seq->ptr<FullyShardImpl>(2)->named_parameters()["weight"];
        weight.set_data(weight.detach().clone());
        model->reshard();
      });
  expect_refused(errors, "weight");
}

TEST_P(FSDPStorage, FullStateDictAfterAReplacementIsRefusedOnEveryRank) {
  auto errors =
      after_one_step(GetParam(), [](FullyShard& model, Sequential& seq, const Communicator&) {
        auto weight = seq->ptr<FullyShardImpl>(2)->named_parameters()["weight"];
        weight.set_data(weight.detach().clone());
        model->full_state_dict();
      });
  expect_refused(errors, "weight");
}

// What does not replace the storage keeps working: the values loaded are the
// ones the next forward computes with.
TEST_P(FSDPStorage, LoadingThroughFullyShardOrInPlaceKeepsWorking) {
  auto errors =
      after_one_step(GetParam(), [](FullyShard& model, Sequential& seq, const Communicator& comm) {
        model->to(torch::kFloat32);  // the dtype it has: nothing changes
        auto twin = make_model(nullptr, {});
        init_parameters(*twin, 11);
        load_from(model, *twin);
        {
          // An in-place write into this rank's rows of a shard.
          torch::NoGradGuard no_grad;
          auto bias = seq->ptr<FullyShardImpl>(4)->named_parameters()["bias"];
          bias.fill_(0.25);
          twin->named_parameters()["4.bias"].fill_(0.25);
        }
        const auto x = local(make_batches(4).x[0], comm);
        const auto got = model->forward(x);
        torch::NoGradGuard no_grad;
        const auto want = twin->forward(x);
        EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6)) << (got - want).abs().max();
      });
  for (const auto& e : errors) EXPECT_EQ(e, kNoError);
}

INSTANTIATE_TEST_SUITE_P(FSDP, FSDPStorage, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::storage_test
