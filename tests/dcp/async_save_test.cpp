// dcp::async_save: its files equal save()'s byte for byte when forward and
// backward run during its staging copy (DDP and FSDP state, worlds 1 and
// 3); what the model does after wait_staged() is not in the checkpoint; a
// tensor changed in place before wait_staged() fails the save on every rank;
// a buffer is copied before it returns, a parameter after; a second save
// commits the first (its .metadata written on the second's background
// thread, a failure of that write thrown on every rank); a write error on
// one rank is thrown on every rank; a save pending on a destroyed
// communicator is no later communicator's, even one built in its memory; a
// process killed mid-write leaves the previous checkpoint loadable and the
// partial one refused.
#include "cohort/dcp/async_save.h"

#include <signal.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "cohort/comm/engine_registry.h"
#include "cohort/core/store/prefix_store.h"
#include "cohort/dcp/checkpoint_file.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::async_save_test {
namespace {

namespace fs = std::filesystem;

std::string contents(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every file of folder `a` (data files and .metadata) equals `b`'s, byte for byte.
void expect_same_files(const fs::path& a, const fs::path& b) {
  int files = 0;
  for (const auto& entry : fs::directory_iterator(a)) {
    const auto name = entry.path().filename();
    EXPECT_EQ(contents(entry.path()), contents(b / name)) << name;
    ++files;
  }
  EXPECT_EQ(files, std::distance(fs::directory_iterator(b), fs::directory_iterator{}));
  EXPECT_TRUE(fs::exists(a / ".metadata"));
}

// Rows [r·kRows, (r+1)·kRows) of a [world·kRows, kCols] float tensor whose
// element (i, j) is i·kCols + j + shift (exact in float: below 2^24).
constexpr int64_t kRows = 1024, kCols = 4096;  // 16 MiB per rank

torch::Tensor rows_of(int rank, float shift) {
  return torch::arange(rank * kRows * kCols, (rank + 1) * kRows * kCols, torch::kFloat)
             .reshape({kRows, kCols}) +
         shift;
}

// "model.big" (no grad: a buffer, copied at the call) or, as `fqn`, an
// optimizer's state (copied on async_save's background thread).
dcp::StateDict rows_state(const torch::Tensor& rows, int64_t first_row, int world,
                          const std::string& fqn = "model.big") {
  dcp::TensorEntry e;
  e.fqn = fqn;
  e.shape = {world * kRows, kCols};
  e.shards.push_back({dcp::Box{{first_row, 0}, {rows.size(0), kCols}}, rows});
  dcp::StateDict sd;
  sd.tensors.push_back(std::move(e));
  return sd;
}

// The whole "model.big" of `dir`, read in one process.
torch::Tensor read_big(const fs::path& dir, const std::string& fqn = "model.big") {
  return dcp::read_tensor(dir, dcp::read_metadata(dir), fqn);
}

class AsyncSave : public ::testing::TestWithParam<int> {};

TEST_P(AsyncSave, DdpStateEqualsTheBlockingSaveWithoutTheStepsAfterIt) {
  const int world = GetParam();
  const auto blocking = temp_dir("ddp_blocking" + std::to_string(world));
  const auto async = temp_dir("ddp_async" + std::to_string(world));
  Named expected;
  std::mutex mu;
  run_ranks(world, [&](Communicator& comm) {
    Net net(1, true);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    train(net, 3, [&] { opt.step(); });
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      expected = snapshot(*net, &opt);
    }
    dcp::save(dcp::get_state_dict(*net, opt), blocking, comm);
    auto pending = dcp::async_save(dcp::get_state_dict(*net, opt), async, comm);
    // Forward and backward run while the parameters and AdamW's state are
    // copied; the steps change them in place.
    train(net, 2, [&] {
      pending.wait_staged();
      opt.step();
    });
    pending.wait();
  });
  expect_same_files(async, blocking);
  run_ranks(1, [&](Communicator& comm) {
    Net net(2, true);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    const auto meta = dcp::read_metadata(async);
    auto sd = dcp::get_state_dict(*net, opt);
    dcp::load(sd, async, comm, &meta);
    expect_equal(snapshot(*net, &opt), expected, "async save, world 1");
  });
  fs::remove_all(blocking);
  fs::remove_all(async);
}

TEST_P(AsyncSave, FsdpStateEqualsTheBlockingSaveWithoutTheStepsAfterIt) {
  const int world = GetParam();
  const auto blocking = temp_dir("fsdp_blocking" + std::to_string(world));
  const auto async = temp_dir("fsdp_async" + std::to_string(world));
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_fsdp(1, comm);
    torch::optim::AdamW opt(model->parameters(), kAdamW);
    train_fsdp(model, opt, 3);
    dcp::save(dcp::get_state_dict(*model, opt), blocking, *comm);
    auto pending = dcp::async_save(dcp::get_state_dict(*model, opt), async, *comm);
    train_fsdp(model, opt, 2, [&] { pending.wait_staged(); });
    pending.wait();
  });
  expect_same_files(async, blocking);
  fs::remove_all(blocking);
  fs::remove_all(async);
}

// 16 MiB per rank, overwritten the moment async_save returns: a buffer
// (forward may change it) must be copied before it returns, or the file or
// its checksums hold the new values.
TEST_P(AsyncSave, ABufferIsCopiedBeforeItReturns) {
  const int world = GetParam();
  const auto dir = temp_dir("staging" + std::to_string(world));
  run_ranks(world, [&](Communicator& comm) {
    auto rows = rows_of(comm.rank(), 0);
    auto pending = dcp::async_save(rows_state(rows, comm.rank() * kRows, world), dir, comm);
    rows.fill_(-1);
    pending.wait();
  });
  torch::Tensor expected = torch::cat([&] {
    std::vector<torch::Tensor> parts;
    for (int r = 0; r < world; ++r) parts.push_back(rows_of(r, 0));
    return parts;
  }());
  EXPECT_TRUE(torch::equal(read_big(dir), expected));
  fs::remove_all(dir);
}

constexpr const char* kState = "optim.big.exp_avg";

// A parameter (it requires grad) is copied in the background, as optimizer
// state is, not at the call: changed in place before wait_staged(), it fails
// the save on every rank.
TEST_P(AsyncSave, AParameterIsCopiedInTheBackground) {
  const int world = GetParam();
  const auto dir = temp_dir("parameter" + std::to_string(world));
  std::mutex mu;
  int failed = 0;
  run_ranks(world, [&](Communicator& comm) {
    auto rows = rows_of(comm.rank(), 0).requires_grad_();
    const auto sd = rows_state(rows, comm.rank() * kRows, world, "model.weight");
    auto pending = dcp::async_save(sd, dir, comm);
    {
      torch::NoGradGuard no_grad;
      rows.add_(1);
    }
    pending.wait_staged();
    try {
      pending.wait();
      ADD_FAILURE() << "no error on rank " << comm.rank();
    } catch (const CheckpointError& e) {
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_NE(std::string(e.what()).find("tensor model.weight was changed in place"),
                std::string::npos)
          << e.what();
      ++failed;
    }
  });
  EXPECT_EQ(failed, world);
  EXPECT_FALSE(fs::exists(dir / ".metadata"));
  fs::remove_all(dir);
}

// ZeRO and the fused optimizer step the parameters through flat buffers
// (the parameters are views of them, with version counters of their own):
// a step before wait_staged() fails a pending async save of the model on
// every rank, as an in-place step of the parameters does. ZeRO with SGD
// without momentum and the fused optimizer before its first step: no
// optimizer state is saved whose own change would show it.
TEST_P(AsyncSave, AFlatBufferStepBeforeWaitStagedFailsTheSave) {
  const int world = GetParam();
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "zero");
    const auto dir =
        temp_dir(std::string(fused ? "fused" : "zero") + "_step" + std::to_string(world));
    std::mutex mu;
    int failed = 0;
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      auto seq = make_seq(1);
      std::unique_ptr<ZeroRedundancyOptimizer> zero;
      std::unique_ptr<FusedDistributedOptimizer> fo;
      if (fused) {
        fo = std::make_unique<FusedDistributedOptimizer>(seq->parameters(), comm, kAdamW);
      } else {
        zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(seq->parameters(), comm,
                                                                torch::optim::SGDOptions(0.1));
      }
      seq->forward(batch(3)).sum().backward();
      auto pending = dcp::async_save(dcp::get_state_dict(seq), dir.string(), *comm);
      fused ? fo->step() : zero->step();
      try {
        pending.wait();
        ADD_FAILURE() << "no error on rank " << comm->rank();
      } catch (const CheckpointError& e) {
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_NE(std::string(e.what()).find("was changed in place"), std::string::npos)
            << e.what();
        ++failed;
      }
    });
    EXPECT_EQ(failed, world);
    EXPECT_FALSE(fs::exists(dir / ".metadata"));
    fs::remove_all(dir);
  }
}

// Optimizer state is copied in the background: changed after wait_staged(),
// the checkpoint holds the values at the call.
TEST_P(AsyncSave, StateChangedAfterWaitStagedIsNotInTheCheckpoint) {
  const int world = GetParam();
  const auto dir = temp_dir("after_staged" + std::to_string(world));
  run_ranks(world, [&](Communicator& comm) {
    auto rows = rows_of(comm.rank(), 0);
    auto pending = dcp::async_save(rows_state(rows, comm.rank() * kRows, world, kState), dir, comm);
    pending.wait_staged();
    EXPECT_TRUE(pending.staged());
    rows.fill_(-1);
    pending.wait();
  });
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < world; ++r) parts.push_back(rows_of(r, 0));
  EXPECT_TRUE(torch::equal(read_big(dir, kState), torch::cat(parts)));
  fs::remove_all(dir);
}

// Changed in place before wait_staged() (an optimizer step too early): the
// copy may be torn, so the save fails on every rank, naming the tensor and
// the rank that changed it, and leaves no checkpoint. Only the last rank
// changes its rows; it does so before the copy can have finished, and it
// would be caught after too (the check is on the caller's thread).
TEST_P(AsyncSave, StateChangedBeforeWaitStagedFailsTheSaveOnEveryRank) {
  const int world = GetParam();
  const auto dir = temp_dir("before_staged" + std::to_string(world));
  const int bad = world - 1;
  std::mutex mu;
  std::vector<std::string> errors;
  run_ranks(world, [&](Communicator& comm) {
    auto rows = rows_of(comm.rank(), 0);
    auto pending = dcp::async_save(rows_state(rows, comm.rank() * kRows, world, kState), dir, comm);
    if (comm.rank() == bad) rows.add_(1);
    pending.wait_staged();  // no throw here: the ranks stay in step
    try {
      pending.wait();
      ADD_FAILURE() << "no error on rank " << comm.rank();
    } catch (const CheckpointError& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), static_cast<size_t>(world));
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank " + std::to_string(bad) + ": dcp::async_save of " + dir.string() +
                     " on rank " + std::to_string(bad) + ": tensor " + kState +
                     " was changed in place before its staging copy was done"),
              std::string::npos)
        << e;
  }
  EXPECT_FALSE(fs::exists(dir / ".metadata"));
  fs::remove_all(dir);
}

TEST_P(AsyncSave, ASecondSaveCommitsTheFirstBeforeItStarts) {
  const int world = GetParam();
  const auto first = temp_dir("first" + std::to_string(world));
  const auto second = temp_dir("second" + std::to_string(world));
  run_ranks(world, [&](Communicator& comm) {
    auto rows = rows_of(comm.rank(), 0);
    auto a = dcp::async_save(rows_state(rows, comm.rank() * kRows, world), first, comm);
    rows.add_(1);
    auto b = dcp::async_save(rows_state(rows, comm.rank() * kRows, world), second, comm);
    // The first is committed: every rank's write finished and agreed on;
    // b's worker writes its .metadata, and a.wait() waits for that. The
    // second is not committed until its wait().
    EXPECT_TRUE(a.ready());
    a.wait();
    EXPECT_TRUE(fs::exists(first / ".metadata"));
    EXPECT_FALSE(fs::exists(second / ".metadata"));
    comm.barrier().wait();  // nobody commits b before every rank looked
    a.wait();               // done already: returns without a collective
    b.wait();
  });
  EXPECT_TRUE(torch::equal(read_big(second), read_big(first) + 1));
  fs::remove_all(first);
  fs::remove_all(second);
}

// A save into the folder of the pending one under another path (a link)
// is a save into the same folder: the call commits the pending save and
// removes its .metadata before anything is written, so until the second
// commits the folder holds no checkpoint, rather than the first's .metadata
// over the second's data files.
TEST_P(AsyncSave, ASaveIntoTheSameFolderUnderAnotherPathIsOne) {
  const int world = GetParam();
  const auto dir = temp_dir("linked" + std::to_string(world));
  const auto links = temp_dir("links" + std::to_string(world));
  fs::create_directory_symlink(dir, links / "to");
  run_ranks(world, [&](Communicator& comm) {
    auto rows = rows_of(comm.rank(), 0);
    auto a = dcp::async_save(rows_state(rows, comm.rank() * kRows, world), dir, comm);
    rows.add_(1);
    auto b = dcp::async_save(rows_state(rows, comm.rank() * kRows, world), links / "to", comm);
    EXPECT_TRUE(a.ready());
    while (!b.ready()) std::this_thread::yield();  // its background thread is done
    comm.barrier().wait();
    EXPECT_FALSE(fs::exists(dir / ".metadata")) << "rank " << comm.rank();
    comm.barrier().wait();  // nobody commits b before every rank looked
    b.wait();
    a.wait();  // committed at b's call: returns without a collective
  });
  // The second save's rows, every rank's.
  EXPECT_TRUE(torch::equal(
      read_big(dir),
      torch::arange(world * kRows * kCols, torch::kFloat).reshape({world * kRows, kCols}) + 1));
  fs::remove_all(links);
  fs::remove_all(dir);
}

TEST_P(AsyncSave, AFailedMetadataWriteOnTheNextSavesThreadThrowsOnEveryRank) {
  const int world = GetParam();
  const auto first = temp_dir("meta_first" + std::to_string(world));
  const auto second = temp_dir("meta_second" + std::to_string(world));
  std::mutex mu;
  std::vector<std::string> errors;
  run_ranks(world, [&](Communicator& comm) {
    auto rows = rows_of(comm.rank(), 0);
    const auto sd = rows_state(rows, comm.rank() * kRows, world);
    auto a = dcp::async_save(sd, first, comm);
    comm.barrier().wait();
    // A folder where the first save's .metadata goes: its rename fails.
    if (comm.rank() == 0) fs::create_directories(first / ".metadata" / "x");
    comm.barrier().wait();
    // The call commits the first (its data files are fine); the .metadata
    // write on b's thread fails, and both waits throw it on every rank.
    auto b = dcp::async_save(sd, second, comm);
    for (auto* pending : {&a, &b}) {
      try {
        pending->wait();
        ADD_FAILURE() << "no error on rank " << comm.rank();
      } catch (const CheckpointError& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e.what());
      }
    }
  });
  ASSERT_EQ(errors.size(), static_cast<size_t>(2 * world));
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 0: dcp::async_save of " + first.string() + " on rank 0: .metadata: "),
              std::string::npos)
        << e;
  }
  EXPECT_FALSE(fs::exists(second / ".metadata"));
  fs::remove_all(first);
  fs::remove_all(second);
}

TEST_P(AsyncSave, AFailedWriteThrowsOnEveryRankAtWaitAndAtTheNextSave) {
  const int world = GetParam();
  const auto dir = temp_dir("fails" + std::to_string(world));
  const auto other = temp_dir("other" + std::to_string(world));
  // A folder where the last rank's data file goes: its rename fails.
  const int bad = world - 1;
  fs::create_directories(dir / dcp::data_file_name(bad) / "x");
  std::mutex mu;
  std::vector<std::string> errors;
  run_ranks(world, [&](Communicator& comm) {
    auto rows = rows_of(comm.rank(), 0);
    const auto sd = rows_state(rows, comm.rank() * kRows, world);
    for (int round = 0; round < 2; ++round) {
      auto pending = dcp::async_save(sd, dir, comm);
      try {
        // Round 0: wait(); round 1: the next save finishes the pending one.
        if (round == 0) {
          pending.wait();
        } else {
          dcp::save(sd, other, comm);
        }
        ADD_FAILURE() << "no error on rank " << comm.rank();
      } catch (const CheckpointError& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back(e.what());
      }
      // A second wait() rethrows the same error, with no collective.
      EXPECT_THROW(pending.wait(), CheckpointError);
    }
  });
  ASSERT_EQ(errors.size(), static_cast<size_t>(2 * world));
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank " + std::to_string(bad) + ": dcp::async_save of " + dir.string() +
                     " on rank " + std::to_string(bad) + ": background write"),
              std::string::npos)
        << e;
  }
  EXPECT_FALSE(fs::exists(dir / ".metadata"));
  EXPECT_FALSE(fs::exists(other / ".metadata"));  // the next save threw before it began
  fs::remove_all(dir);
  fs::remove_all(other);
}

// A save left pending on a communicator that is then destroyed: a
// communicator built later in the same memory (the same address) neither
// commits it nor waits for it at its own save, and its wait() throws on
// every rank, since the ranks can no longer agree on it.
TEST_P(AsyncSave, APendingSaveOfADestroyedCommunicatorIsNoLaterOnes) {
  const int world = GetParam();
  const auto first = temp_dir("gone_first" + std::to_string(world));
  const auto second = temp_dir("gone_second" + std::to_string(world));
  // Store key spaces of this run alone (ranks as processes share one store).
  static int runs = 0;
  const std::string run = "async_gone" + std::to_string(runs++) + "/";
  run_ranks(world, [&](Communicator& comm) {
    // A communicator over the world's ranks, built in `slot`.
    std::optional<Communicator> slot;
    auto build = [&](const std::string& key_space) {
      auto store = std::make_shared<PrefixStore>(run + key_space, comm.store());
      ConnectOptions co;
      static_cast<CommunicatorOptions&>(co) = comm.options();
      co.backend = comm.backend();
      slot.emplace(create_engine(store, comm.rank(), comm.size(), co), store, co);
      return &*slot;
    };
    auto rows = rows_of(comm.rank(), 0);
    const Communicator* gone = build("gone");
    auto pending = dcp::async_save(rows_state(rows, comm.rank() * kRows, world), first, *slot);
    slot.reset();  // its background write may still be going on
    ASSERT_EQ(build("new"), gone);
    rows.add_(1);
    dcp::save(rows_state(rows, comm.rank() * kRows, world), second, *slot);
    comm.barrier().wait();
    EXPECT_FALSE(fs::exists(first / ".metadata")) << "rank " << comm.rank();
    // Checked here: with ranks as processes, each sees its own.
    try {
      pending.wait();
      ADD_FAILURE() << "no error on rank " << comm.rank();
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("dcp::async_save of " + first.string() + " on rank " +
                          std::to_string(comm.rank()) +
                          ": its communicator was destroyed before wait(): the save was never "
                          "committed"),
                std::string::npos)
          << what;
    }
  });
  EXPECT_FALSE(fs::exists(first / ".metadata"));
  EXPECT_TRUE(torch::equal(
      read_big(second),
      torch::arange(world * kRows * kCols, torch::kFloat).reshape({world * kRows, kCols}) + 1));
  fs::remove_all(first);
  fs::remove_all(second);
}

INSTANTIATE_TEST_SUITE_P(Worlds, AsyncSave, ::testing::Values(1, 3));

constexpr const char* kKillDir = "COHORT_ASYNC_SAVE_KILL_DIR";

// The child of the next test (skipped when run on its own): three ranks
// start an async save of step1, change their rows after its staging, start
// an async save of step2 (whose background thread writes step1's .metadata
// before its own copy), and rank 0 SIGKILLs the process while the writers
// are busy.
TEST(AsyncSaveKill, Child) {
  const char* dir = std::getenv(kKillDir);
  if (dir == nullptr) GTEST_SKIP() << "runs as the child of KilledMidWrite";
  run_ranks(3, [&](Communicator& comm) {
    auto rows = rows_of(comm.rank(), 0);
    const auto sd = rows_state(rows, comm.rank() * kRows, 3);
    auto first = dcp::async_save(sd, std::string(dir) + "/step1", comm);
    first.wait_staged();
    rows.add_(1);
    auto pending = dcp::async_save(sd, std::string(dir) + "/step2", comm);
    pending.wait_staged();
    comm.barrier().wait();
    if (comm.rank() == 0) ::raise(SIGKILL);
    pending.wait();
  });
}

TEST(AsyncSaveKill, KilledMidWriteLeavesThePreviousCheckpointAndRefusesThePartialOne) {
  const auto dir = temp_dir("killed");
  Subprocess child({"/proc/self/exe", "--gtest_filter=AsyncSaveKill.Child"},
                   {std::string(kKillDir) + "=" + dir.string()});
  const auto r = child.finish(Seconds(120));
  ASSERT_FALSE(r.timed_out) << r.out << r.err;
  ASSERT_EQ(r.exit_code, 128 + SIGKILL) << r.out << r.err;
  std::vector<torch::Tensor> parts;
  for (int rank = 0; rank < 3; ++rank) parts.push_back(rows_of(rank, 0));
  EXPECT_TRUE(torch::equal(read_big(dir / "step1"), torch::cat(parts)));
  EXPECT_THROW(read_big(dir / "step2"), CheckpointError);
  // Saving into the folder again clears what the killed writers left.
  run_ranks(1, [&](Communicator& comm) {
    auto rows = rows_of(0, 7);
    dcp::async_save(rows_state(rows, 0, 1), dir / "step2", comm).wait();
  });
  for (const auto& entry : fs::directory_iterator(dir / "step2")) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
  }
  EXPECT_TRUE(torch::equal(read_big(dir / "step2"), rows_of(0, 7)));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace cohort::testing::dcp_test::async_save_test
