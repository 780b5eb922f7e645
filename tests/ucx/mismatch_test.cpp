// Ranks that call different collectives over UCX, with the debug checks
// off: every rank gets a MismatchError naming both collectives well before
// the operation's timeout, for each way two calls can differ (size, kind,
// dtype, reduce op, root, number of calls), at world 2 and 3. Rank 0 is the
// odd one out; ranks as threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "support/thread_ranks.h"

namespace cohort::testing::mismatch_test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Far above the bound below: an error that waits for the timeout fails.
constexpr auto kTimeout = 30s;
constexpr double kBoundSeconds = 5.0;

struct Case {
  const char* name;
  // What rank `r` calls (rank 0 differs); throws what the call throws.
  std::function<void(Communicator&)> call;
  // Both collectives, as every rank's message must name them.
  std::string odd, usual;
};

torch::Tensor floats(int64_t n) { return torch::ones({n}); }

void all_reduce(Communicator& c, torch::Tensor t, ReduceOp op = ReduceOp::Sum) {
  AllReduceOptions o;
  o.op = op;
  c.all_reduce(t, o).wait();
}

void broadcast(Communicator& c, torch::Tensor t, int root) {
  BroadcastOptions o;
  o.root = root;
  c.broadcast(t, o).wait();
}

std::vector<Case> cases() {
  return {
      {"Size", [](Communicator& c) { all_reduce(c, floats(c.rank() == 0 ? 100 : 10)); },
       "all_reduce (float32, 100 elements, sum)", "all_reduce (float32, 10 elements, sum)"},
      {"Kind",
       [](Communicator& c) {
         if (c.rank() == 0) return broadcast(c, floats(10), 0);
         all_reduce(c, floats(10));
       },
       "broadcast (float32, 10 elements, root 0)", "all_reduce (float32, 10 elements, sum)"},
      {"Dtype",
       [](Communicator& c) {
         all_reduce(c, c.rank() == 0 ? torch::ones({10}, torch::kInt) : floats(10));
       },
       "all_reduce (int32, 10 elements, sum)", "all_reduce (float32, 10 elements, sum)"},
      {"ReduceOp",
       [](Communicator& c) {
         all_reduce(c, floats(10), c.rank() == 0 ? ReduceOp::Max : ReduceOp::Sum);
       },
       "all_reduce (float32, 10 elements, max)", "all_reduce (float32, 10 elements, sum)"},
      {"Root", [](Communicator& c) { broadcast(c, floats(10), c.rank() == 0 ? 0 : 1); },
       "broadcast (float32, 10 elements, root 0)", "broadcast (float32, 10 elements, root 1)"},
      {"NumberOfCalls",
       [](Communicator& c) {
         all_reduce(c, floats(10));
         if (c.rank() == 0) return all_reduce(c, floats(10));
         c.barrier().wait();
       },
       "all_reduce (float32, 10 elements, sum)", "barrier"},
      // At world 2, 1 MiB is the largest direct exchange (its message is its
      // check) and 1 MiB + 8 bytes takes the ring.
      {"SizeAcrossTheDirectExchangeLimit",
       [](Communicator& c) { all_reduce(c, floats(c.rank() == 0 ? 262144 : 262146)); },
       "all_reduce (float32, 262144 elements, sum)", "all_reduce (float32, 262146 elements, sum)"},
      {"DtypeOfAMegabyte",
       [](Communicator& c) {
         all_reduce(c, c.rank() == 0 ? torch::ones({262144}, torch::kInt) : floats(262144));
       },
       "all_reduce (int32, 262144 elements, sum)", "all_reduce (float32, 262144 elements, sum)"},
  };
}

class UcxMismatch : public ::testing::TestWithParam<std::tuple<int, int>> {};

// Every rank compares every other rank's check, so each finds the
// difference in its own call, at world 3 too (a rank that does not is a
// failure; its next collective is tried only to say whether it learns late).
TEST_P(UcxMismatch, IsAMismatchErrorOnEveryRankNamingBothCollectives) {
  const auto [world, index] = GetParam();
  const auto c = cases()[static_cast<size_t>(index)];
  ThreadRanksOptions o;
  o.backend = "ucx";
  o.timeout = kTimeout;
  std::mutex mu;
  double slowest = 0;
  int late = 0;  // ranks that learned it on their next call
  run_ranks(
      world,
      [&](Communicator& comm) {
        const auto start = Clock::now();
        std::string message;
        try {
          try {
            c.call(comm);
          } catch (const MismatchError&) {
            throw;
          } catch (const std::exception& e) {
            ADD_FAILURE() << "rank " << comm.rank() << ": not a MismatchError: " << e.what();
            return;
          }
          ADD_FAILURE() << "rank " << comm.rank() << ": no error";
          {
            std::lock_guard<std::mutex> lock(mu);
            ++late;
          }
          comm.barrier().wait();
          ADD_FAILURE() << "rank " << comm.rank() << ": no error, not even on the next call";
        } catch (const MismatchError& e) {
          message = e.what();
        } catch (const std::exception& e) {
          ADD_FAILURE() << "rank " << comm.rank() << ": not a MismatchError: " << e.what();
        }
        const double s = std::chrono::duration<double>(Clock::now() - start).count();
        {
          std::lock_guard<std::mutex> lock(mu);
          slowest = std::max(slowest, s);
        }
        EXPECT_LT(s, kBoundSeconds) << "rank " << comm.rank() << " waited for the timeout";
        if (message.empty()) return;
        EXPECT_NE(message.find(c.odd), std::string::npos) << message;
        EXPECT_NE(message.find(c.usual), std::string::npos) << message;
        EXPECT_NE(message.find("the ranks called different collectives"), std::string::npos)
            << message;
        // The Communicator names the operation and this rank.
        EXPECT_NE(
            message.find("on rank " + std::to_string(comm.rank()) + " of " + std::to_string(world)),
            std::string::npos)
            << message;
      },
      o);
  std::printf(
      "[ measured ] %s, world %d: the slowest rank's error after %.1f ms (%d rank(s) on "
      "the next call)\n",
      c.name, world, slowest * 1e3, late);
}

// A rank that calls more collectives than its peers, which then close their
// communicators: it learns at once that they never will.
TEST(UcxMismatch, ACollectiveThePeersNeverCallFailsWhenTheyClose) {
  for (int world : {2, 3}) {
    ThreadRanksOptions o;
    o.backend = "ucx";
    o.timeout = kTimeout;
    double took = 0;
    run_ranks_shared(
        world,
        [&](std::shared_ptr<Communicator> comm) {
          all_reduce(*comm, floats(10));
          if (comm->rank() != 0) return comm.reset();
          const auto start = Clock::now();
          try {
            all_reduce(*comm, floats(10));
            ADD_FAILURE() << "no error";
          } catch (const MismatchError& e) {
            const std::string m = e.what();
            EXPECT_NE(m.find("collective #2 (this rank called all_reduce (float32, 10 elements, "
                             "sum)): rank "),
                      std::string::npos)
                << m;
            EXPECT_NE(m.find("closed its communicator after 1 collective(s): the ranks called "
                             "different numbers of collectives"),
                      std::string::npos)
                << m;
          }
          took = std::chrono::duration<double>(Clock::now() - start).count();
          EXPECT_LT(took, kBoundSeconds);
        },
        o);
    std::printf("[ measured ] peers closed, world %d: rank 0's error after %.1f ms\n", world,
                took * 1e3);
  }
}

std::string name_of(const ::testing::TestParamInfo<std::tuple<int, int>>& info) {
  return std::string(cases()[static_cast<size_t>(std::get<1>(info.param))].name) + "World" +
         std::to_string(std::get<0>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Cases, UcxMismatch,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Range(0, 8)),
                         name_of);

}  // namespace
}  // namespace cohort::testing::mismatch_test
