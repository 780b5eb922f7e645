// Failure behaviour with ranks as threads: bad tensors, debug-mode mismatch,
// a rank that never arrives, a peer that goes away. Every case must end in a
// named error within its timeout.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>

#include "support/thread_ranks.h"

namespace cohort::testing::errors_test {
namespace {

using namespace std::chrono_literals;

// Runs `call` and returns the message of the exception of type E it throws.
template <typename E, typename F>
std::string message_of(F&& call) {
  try {
    call();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

TEST(BadTensors, AreRefusedBeforeAnythingIsSent) {
  run_ranks(2, [](Communicator& comm) {
    auto nc = torch::zeros({4, 4}).t();
    auto m = message_of<InvalidArgument>([&] { (void)comm.all_reduce(nc); });
    EXPECT_NE(m.find("not contiguous"), std::string::npos) << m;
    EXPECT_NE(m.find("all_reduce on rank " + std::to_string(comm.rank()) + " of 2"), std::string::npos) << m;

    auto b = torch::zeros({3}, torch::kBool);
    m = message_of<InvalidArgument>([&] { (void)comm.broadcast(b); });
    EXPECT_NE(m.find("dtype Bool"), std::string::npos) << m;

    auto meta = torch::empty({3}, torch::TensorOptions().device(torch::kMeta));
    m = message_of<InvalidArgument>([&] { (void)comm.all_reduce(meta); });
    EXPECT_NE(m.find("device meta"), std::string::npos) << m;

    auto in = torch::zeros({3});
    std::vector<torch::Tensor> outs{torch::zeros({3})};
    m = message_of<InvalidArgument>([&] { (void)comm.all_gather(outs, in); });
    EXPECT_NE(m.find("one per rank"), std::string::npos) << m;

    std::vector<torch::Tensor> wrong{torch::zeros({3}), torch::zeros({4})};
    m = message_of<InvalidArgument>([&] { (void)comm.all_gather(wrong, in); });
    EXPECT_NE(m.find("outputs[1] has shape [4], expected [3]"), std::string::npos) << m;

    // The communicator is still usable: nothing was sent.
    auto ok = torch::ones({2});
    comm.all_reduce(ok).wait();
    EXPECT_EQ(ok[0].item<float>(), 2.0f);
  });
}

// A one-element tensor is contiguous whatever its stride (one column of a
// row, here stride 3): data movement carries it like any other, in 16-bit
// dtypes too (Gloo moves them as bytes).
TEST(BadTensors, OneElementTensorsWithAnyStrideMove) {
  run_ranks(2, [](Communicator& comm) {
    const double mine = comm.rank() + 1;
    auto row = torch::full({1, 3}, mine, torch::kHalf);
    auto one = row.select(1, 1);
    ASSERT_TRUE(one.is_contiguous());
    ASSERT_EQ(one.stride(0), 3);

    std::vector<torch::Tensor> outs{torch::zeros({1}, torch::kHalf),
                                    torch::zeros({1}, torch::kHalf)};
    comm.all_gather(outs, one).wait();
    EXPECT_EQ(outs[0].item<double>(), 1.0);
    EXPECT_EQ(outs[1].item<double>(), 2.0);

    std::vector<torch::Tensor> both{one};
    comm.broadcast_coalesced(both, {/*root=*/1}).wait();
    EXPECT_EQ(one.item<double>(), 2.0);

    row.fill_(mine);
    comm.broadcast(one, {/*root=*/0}).wait();
    EXPECT_EQ(one.item<double>(), 1.0);
    // The other columns are the rank's own: only the element moved.
    EXPECT_EQ(row[0][0].item<double>(), mine);
    EXPECT_EQ(row[0][2].item<double>(), mine);
  });
}

// A tensor on a device cohort does not carry (meta) is refused by every
// operation that stages device tensors, before anything is sent, naming
// the operation: the same path a CUDA tensor takes to its host copy.
TEST(BadTensors, OnAnotherDeviceAreRefusedByEveryOperation) {
  run_ranks(2, [](Communicator& comm) {
    const auto meta = [] { return torch::empty({2}, torch::TensorOptions().device(torch::kMeta)); };
    const auto cpu = [] { return torch::zeros({2}); };
    const int peer = 1 - comm.rank();
    std::vector<std::pair<std::string, std::function<void()>>> ops = {
        {"all_reduce",
         [&] {
           auto t = meta();
           (void)comm.all_reduce(t);
         }},
        {"all_reduce_coalesced",
         [&] {
           std::vector<torch::Tensor> ts{cpu(), meta()};
           (void)comm.all_reduce_coalesced(ts);
         }},
        {"broadcast",
         [&] {
           auto t = meta();
           (void)comm.broadcast(t);
         }},
        {"broadcast_coalesced",
         [&] {
           std::vector<torch::Tensor> ts{meta()};
           (void)comm.broadcast_coalesced(ts);
         }},
        {"reduce",
         [&] {
           auto t = meta();
           (void)comm.reduce(t);
         }},
        {"all_gather",
         [&] {
           std::vector<torch::Tensor> o{cpu(), meta()};
           (void)comm.all_gather(o, cpu());
         }},
        {"all_gather_into_tensor",
         [&] {
           auto o = torch::zeros({4});
           (void)comm.all_gather_into_tensor(o, meta());
         }},
        {"reduce_scatter",
         [&] {
           auto o = meta();
           (void)comm.reduce_scatter(o, {cpu(), cpu()});
         }},
        {"reduce_scatter_tensor",
         [&] {
           auto o = cpu();
           (void)comm.reduce_scatter_tensor(
               o, torch::empty({4}, torch::TensorOptions().device(torch::kMeta)));
         }},
        {"gather",
         [&] {
           std::vector<torch::Tensor> o{cpu(), cpu()};
           (void)comm.gather(o, meta());
         }},
        {"scatter",
         [&] {
           auto o = meta();
           (void)comm.scatter(o, {cpu(), cpu()});
         }},
        {"all_to_all_single",
         [&] {
           auto o = cpu();
           (void)comm.all_to_all_single(o, meta());
         }},
        {"all_to_all",
         [&] {
           std::vector<torch::Tensor> o{cpu(), cpu()};
           (void)comm.all_to_all(o, {meta(), cpu()});
         }},
        {"send", [&] { (void)comm.send(meta(), peer); }},
        {"recv",
         [&] {
           auto t = meta();
           (void)comm.recv(t, peer);
         }},
    };
    for (auto& [op, run] : ops) {
      const auto m = message_of<InvalidArgument>(run);
      EXPECT_NE(m.find(op + " on rank " + std::to_string(comm.rank()) + " of 2"), std::string::npos)
          << m;
      EXPECT_NE(m.find("is on device meta; cohort carries CPU and CUDA tensors"), std::string::npos)
          << m;
    }
    // Nothing was sent: the next collective pairs up as usual.
    auto ok = torch::ones({2});
    comm.all_reduce(ok).wait();
    EXPECT_EQ(ok[0].item<float>(), 2.0f);
  });
}

TEST(DebugMode, ShapeMismatchNamesTheRanksAndShapes) {
  ThreadRanksOptions opts;
  opts.debug_checks = true;
  opts.timeout = 10s;
  run_ranks(3, [](Communicator& comm) {
    auto t = torch::zeros({comm.rank() == 1 ? 5 : 4});
    auto m = message_of<MismatchError>([&] { (void)comm.all_reduce(t); });
    EXPECT_NE(m.find("ranks [0, 2] called all_reduce(op=sum, dtype=float32, shape=[4])"),
              std::string::npos) << m;
    EXPECT_NE(m.find("rank 1 called all_reduce(op=sum, dtype=float32, shape=[5])"),
              std::string::npos) << m;
  }, opts);
}

TEST(DebugMode, DifferentOperationsAreNamed) {
  ThreadRanksOptions opts;
  opts.debug_checks = true;
  run_ranks(2, [](Communicator& comm) {
    auto t = torch::zeros({4}, torch::kFloat64);
    auto m = message_of<MismatchError>([&] {
      if (comm.rank() == 0) {
        (void)comm.all_reduce(t);
      } else {
        (void)comm.broadcast(t);
      }
    });
    EXPECT_NE(m.find("broadcast(root=0, dtype=float64"), std::string::npos) << m;
    EXPECT_NE(m.find("all_reduce(op=sum, dtype=float64"), std::string::npos) << m;
  }, opts);
}

TEST(DebugMode, ARankThatNeverArrivesIsNamed) {
  ThreadRanksOptions opts;
  opts.debug_checks = true;
  std::atomic<int> arrived{0};
  run_ranks(
      3,
      [&](Communicator& comm) {
        if (comm.rank() == 2) return;  // skips the collective
        // Ranks 0 and 1 start together, so that within the check's wait only
        // rank 2 is missing, however the threads are scheduled.
        ++arrived;
        while (arrived < 2) std::this_thread::sleep_for(1ms);
        auto t = torch::zeros({4});
        auto start = std::chrono::steady_clock::now();
        auto m = message_of<TimeoutError>([&] { (void)comm.all_reduce(t, {ReduceOp::Sum, 3s}); });
        EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
        EXPECT_NE(m.find("rank 2 did not reach it"), std::string::npos) << m;
      },
      opts);
}

TEST(Timeouts, ASilentPeerMakesWaitThrowNamingTheOperation) {
  ThreadRanksOptions opts;
  opts.timeout = 3s;  // the transport's own limit, for the abandoned operation
  std::atomic<bool> rank0_done{false};
  run_ranks(2, [&](Communicator& comm) {
    if (comm.rank() == 1) {
      // Alive but silent until rank 0 gave up.
      while (!rank0_done) std::this_thread::sleep_for(1ms);
      return;
    }
    auto t = torch::zeros({16});
    auto work = comm.all_reduce(t, {ReduceOp::Sum, 500ms});
    auto start = std::chrono::steady_clock::now();
    auto m = message_of<TimeoutError>([&] { work.wait(); });
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
    EXPECT_NE(m.find("all_reduce on rank 0 of 2 (group world, peer 1) timed out after 500 ms"),
              std::string::npos) << m;
    EXPECT_NE(m.find("rerun with COHORT_DEBUG=detail"), std::string::npos) << m;
    // A failed communicator refuses further work instead of corrupting it.
    auto again = message_of<PeerError>([&] { (void)comm.all_reduce(t); });
    EXPECT_NE(again.find("failed earlier"), std::string::npos) << again;
    rank0_done = true;
  }, opts);
}

TEST(PeerFailure, APeerThatLeavesMidCollectiveFailsTheSurvivors) {
  ThreadRanksOptions opts;
  opts.timeout = 5s;
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    auto t = torch::ones({1 << 16});
    comm->all_reduce(t).wait();  // everyone connected and working
    if (comm->rank() == 2) {
      comm.reset();  // closes this rank's connections, as a crash would
      return;
    }
    auto start = std::chrono::steady_clock::now();
    bool failed = false;
    try {
      comm->all_reduce(t).wait();
    } catch (const PeerError& e) {
      failed = true;
      EXPECT_NE(std::string(e.what()).find("all_reduce on rank " + std::to_string(comm->rank())),
                std::string::npos) << e.what();
    } catch (const TimeoutError& e) {
      failed = true;
    }
    EXPECT_TRUE(failed);
    EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);  // the 5 s timeout at the latest
  }, opts);
}

TEST(Options, NonPositiveTimeoutAndBadRootAreRefused) {
  run_ranks(2, [](Communicator& comm) {
    auto t = torch::zeros({2});
    EXPECT_THROW((void)comm.all_reduce(t, {ReduceOp::Sum, 0ms}), InvalidArgument);
    EXPECT_THROW((void)comm.broadcast(t, {2}), InvalidArgument);
    EXPECT_THROW((void)comm.reduce(t, {-1}), InvalidArgument);
  });
}

}  // namespace
}  // namespace cohort::testing::errors_test
