// dcp::load while an async save is pending on the same communicator (the
// training went on after the call; nobody waited): a load of another
// folder (a rollback) leaves the pending save holding the state at its
// call, and a load of the pending save's own folder loads what it saved.
// Each over gloo and UCX at worlds 1 and 3, the model and AdamW state
// compared by name with the state at the call.
#include <mutex>

#include "cohort/dcp/async_save.h"
#include "support/engine_worlds.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::async_load_test {
namespace {

namespace fs = std::filesystem;

class AsyncLoad : public ::testing::TestWithParam<EngineWorld> {};

// Trains a Net 2 steps and async-saves it into `pending_dir` (the state at
// the call: `at_call`), trains 2 more steps, then loads `load_dir` into it;
// returns what each rank holds after the load and what `pending_dir` holds
// after the pending save's wait().
void save_train_load(const EngineWorld& engine, const fs::path& pending_dir,
                     const fs::path& load_dir, Named& at_call, std::map<int, Named>& loaded) {
  std::mutex mu;
  run_ranks(
      engine.world,
      [&](Communicator& comm) {
        Net net(1, false);
        torch::optim::AdamW opt(net->parameters(), kAdamW);
        train(net, 2, [&] { opt.step(); });
        if (comm.rank() == 0) at_call = snapshot(*net, &opt);
        auto pending = dcp::async_save(dcp::get_state_dict(*net, opt), pending_dir, comm);
        train(net, 2, [&] {
          pending.wait_staged();
          opt.step();
        });
        auto sd = dcp::get_state_dict(*net, opt);
        dcp::load(sd, load_dir, comm);
        {
          std::lock_guard<std::mutex> lock(mu);
          loaded[comm.rank()] = snapshot(*net, &opt);
        }
        pending.wait();
      },
      options_for(engine));
}

// The Net and AdamW of `dir`, loaded in one process.
Named load_alone(const fs::path& dir) {
  Named out;
  run_ranks(1, [&](Communicator& comm) {
    Net net(3, false);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    auto sd = dcp::get_state_dict(*net, opt);
    dcp::load(sd, dir, comm);
    out = snapshot(*net, &opt);
  });
  return out;
}

TEST_P(AsyncLoad, ALoadOfAnotherFolderLeavesThePendingSavesState) {
  const auto& engine = GetParam();
  const auto old = temp_dir("async_load_old_" + engine_world_name({engine, 0}));
  const auto dir = temp_dir("async_load_pending_" + engine_world_name({engine, 0}));
  Named before;  // the checkpoint rolled back to: one step
  run_ranks(
      engine.world,
      [&](Communicator& comm) {
        Net net(1, false);
        torch::optim::AdamW opt(net->parameters(), kAdamW);
        train(net, 1, [&] { opt.step(); });
        if (comm.rank() == 0) before = snapshot(*net, &opt);
        dcp::save(dcp::get_state_dict(*net, opt), old, comm);
      },
      options_for(engine));
  Named at_call;
  std::map<int, Named> loaded;
  save_train_load(engine, dir, old, at_call, loaded);
  for (const auto& [rank, got] : loaded) expect_equal(got, before, "rank " + std::to_string(rank));
  expect_equal(load_alone(dir), at_call, "the pending save");
  fs::remove_all(old);
  fs::remove_all(dir);
}

TEST_P(AsyncLoad, ALoadOfThePendingSavesFolderLoadsWhatItSaved) {
  const auto& engine = GetParam();
  const auto dir = temp_dir("async_load_same_" + engine_world_name({engine, 0}));
  Named at_call;
  std::map<int, Named> loaded;
  save_train_load(engine, dir, dir, at_call, loaded);
  ASSERT_EQ(loaded.size(), static_cast<size_t>(engine.world));
  for (const auto& [rank, got] : loaded) expect_equal(got, at_call, "rank " + std::to_string(rank));
  expect_equal(load_alone(dir), at_call, "the pending save");
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Engines, AsyncLoad, ::testing::ValuesIn(engine_worlds({1, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::dcp_test::async_load_test
