// dcp and a fully sharded model whose parameter's storage was replaced after
// fully_shard (set_data, Module::to of another dtype; torch::load set_()s
// alike), ranks as threads over Gloo and UCX at world 1 to 3: the model's
// units hold values the parameter no longer shows, so saving would write
// the replacement and loading would fill a tensor the model no longer
// uses. dcp::save (of a state dict taken before or after the replacement)
// and dcp::load refuse on every rank, naming the parameter and the
// replacing rank, with no checkpoint committed and nothing loaded;
// dcp::set_state_dict refuses on the rank that replaced it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "cohort/dcp/safetensors.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::dcp_fsdp_storage_test {
namespace {

using namespace cohort::testing::dcp_test;
using cohort::testing::EngineWorld;
namespace fs = std::filesystem;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Replaces the storage of parameter "2.weight" (unit '2', a Linear(7, 3))
// with other values.
void replace(FullyShard& model) {
  auto w = model->named_parameters()["2.weight"];
  w.set_data(torch::full_like(w, 3.0));
}

// Every rank refused, each with the replacing rank's reason (`rank` of it).
void expect_refused(const std::vector<std::string>& errors, int rank) {
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    EXPECT_TRUE(has(e, "'2.weight'")) << "rank " << r << ": " << e;
    EXPECT_TRUE(has(e, "no longer holds the storage fully_shard gave it")) << e;
    EXPECT_TRUE(has(e, "on rank " + std::to_string(rank))) << e;
  }
}

cohort::testing::ThreadRanksOptions options(const EngineWorld& c) {
  auto o = cohort::testing::options_for(c);
  o.timeout = std::chrono::seconds(5);
  return o;
}

class DcpFSDPStorage : public ::testing::TestWithParam<EngineWorld> {};

// load_weights with options.comm: one rank's replacement is an
// InvalidArgument on every rank, as at save and load.
TEST_P(DcpFSDPStorage, LoadWeightsAfterOneRanksReplacementIsRefusedOnEveryRank) {
  const auto c = GetParam();
  const auto dir = temp_dir("fsdp_storage_weights_" + cohort::testing::engine_world_name({c, 0}));
  const auto path = (dir / "w.safetensors").string();
  auto source = make_seq(1);
  dcp::NamedTensors t;
  for (const auto& p : source->named_parameters()) t.insert(p.key(), p.value());
  dcp::save_safetensors(t, path);
  const int last = c.world - 1;
  std::vector<int> invalid_argument(static_cast<size_t>(c.world), 0);
  const auto errors = cohort::testing::errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto model = make_fsdp(2, comm);
        if (comm->rank() == last) replace(model);
        auto sd = dcp::get_state_dict(model);
        dcp::LoadWeightsOptions options;
        options.comm = comm.get();
        try {
          dcp::load_weights(sd, path, options);
        } catch (const InvalidArgument&) {
          invalid_argument[static_cast<size_t>(comm->rank())] = 1;
          throw;
        }
      },
      options(c));
  expect_refused(errors, last);
  for (int r = 0; r < c.world; ++r) EXPECT_EQ(invalid_argument[r], 1) << "rank " << r;
  fs::remove_all(dir);
}

// load_full_state_dict writes the shards through the unit's flat buffer:
// before wait_staged(), a pending async save of the model sees the change
// and fails on every rank, as for an in-place write to the parameter.
TEST_P(DcpFSDPStorage, LoadFullStateDictDuringAnAsyncSaveFailsTheSave) {
  const auto c = GetParam();
  const auto dir = temp_dir("fsdp_async_load_full_" + cohort::testing::engine_world_name({c, 0}));
  const auto errors = cohort::testing::errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto model = make_fsdp(1, comm);
        torch::optim::AdamW opt(model->parameters(), kAdamW);
        train_fsdp(model, opt, 1);
        const auto full = model->full_state_dict();
        auto pending = dcp::async_save(dcp::get_state_dict(model), dir.string(), *comm);
        model->load_full_state_dict(full);
        pending.wait();
      },
      options(c));
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_TRUE(has(errors[r], "was changed in place before its staging copy was done"))
        << "rank " << r << ": " << errors[r];
  }
  EXPECT_FALSE(fs::exists(dir / ".metadata")) << "the checkpoint was committed";
  fs::remove_all(dir);
}

TEST_P(DcpFSDPStorage, SaveAfterOneRanksReplacementIsRefusedOnEveryRank) {
  const auto c = GetParam();
  const auto dir = temp_dir("fsdp_storage_save_" + cohort::testing::engine_world_name({c, 0}));
  const int last = c.world - 1;
  for (bool taken_before : {false, true}) {
    SCOPED_TRACE(taken_before ? "state dict taken before" : "state dict taken after");
    const auto errors = cohort::testing::errors_on_every_rank(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          auto model = make_fsdp(1, comm);
          torch::optim::AdamW opt(model->parameters(), kAdamW);
          train_fsdp(model, opt, 1);
          auto before = dcp::get_state_dict(model, opt);
          if (comm->rank() == last) replace(model);
          dcp::save(taken_before ? before : dcp::get_state_dict(model, opt), dir.string(), *comm);
        },
        options(c));
    expect_refused(errors, last);
    EXPECT_FALSE(fs::exists(dir / ".metadata")) << "the checkpoint was committed";
  }
  fs::remove_all(dir);
}

TEST_P(DcpFSDPStorage, LoadAfterOneRanksReplacementIsRefusedOnEveryRank) {
  const auto c = GetParam();
  const auto dir = temp_dir("fsdp_storage_load_" + cohort::testing::engine_world_name({c, 0}));
  const int last = c.world - 1;
  cohort::testing::run_ranks_shared(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto model = make_fsdp(2, comm);
        torch::optim::AdamW opt(model->parameters(), kAdamW);
        train_fsdp(model, opt, 1);
        dcp::save(dcp::get_state_dict(model, opt), dir.string(), *comm);
      },
      cohort::testing::options_for(c));
  const auto errors = cohort::testing::errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto model = make_fsdp(1, comm);
        torch::optim::AdamW opt(model->parameters(), kAdamW);
        train_fsdp(model, opt, 1);
        auto sd = dcp::get_state_dict(model, opt);
        if (comm->rank() == last) replace(model);
        try {
          dcp::load(sd, dir.string(), *comm);
        } catch (...) {
          if (comm->rank() == last) {
            EXPECT_TRUE(torch::all(model->named_parameters()["2.weight"] == 3).item<bool>())
                << "the replacement was loaded into";
          }
          throw;
        }
      },
      options(c));
  expect_refused(errors, last);
  fs::remove_all(dir);
}

TEST_P(DcpFSDPStorage, SetStateDictAfterAReplacementIsRefused) {
  const auto c = GetParam();
  const auto errors = cohort::testing::errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        auto source = make_fsdp(2, comm);
        auto model = make_fsdp(1, comm);
        torch::optim::AdamW opt(model->parameters(), kAdamW);
        train_fsdp(model, opt, 1);
        replace(model);
        dcp::set_state_dict(model, opt, dcp::get_state_dict(source));
      },
      options(c));
  for (int r = 0; r < c.world; ++r) {
    expect_refused({errors[static_cast<size_t>(r)]}, r);
    EXPECT_TRUE(has(errors[static_cast<size_t>(r)], "dcp::set_state_dict"))
        << errors[static_cast<size_t>(r)];
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, DcpFSDPStorage,
                         ::testing::ValuesIn(cohort::testing::engine_worlds()),
                         cohort::testing::engine_world_name);

}  // namespace
}  // namespace cohort::dcp_fsdp_storage_test
