// The UCX engine's own behaviour, ranks as threads (each rank its own UCX
// context and worker): sizes that differ are errors on both ranks, a rank
// that never sends is a timeout, transfers progress while the caller
// computes, and a single-host group listens on no socket.
#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "support/thread_ranks.h"

namespace cohort::testing::engine_test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

ThreadRanksOptions ucx(Millis timeout = 20s) {
  ThreadRanksOptions o;
  o.backend = "ucx";
  o.timeout = timeout;
  return o;
}

template <typename E, typename F>
std::string message_of(F&& call) {
  try {
    call();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "another exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

TEST(UcxEngine, LargerMessageThanBufferFailsOnBothRanks) {
  const auto start = Clock::now();
  run_ranks(
      2,
      [](Communicator& comm) {
        if (comm.rank() == 0) {
          auto t = torch::ones({1000});
          comm.send(t, 1).wait();
          // The receiver's notice fails this rank's next wait.
          auto more = torch::zeros({1});
          auto m = message_of<MismatchError>([&] { comm.recv(more, 1).wait(); });
          EXPECT_NE(m.find("rank 1 reports the message (4000 bytes, float32) was larger than its "
                           "receive buffer (40 bytes, float32)"),
                    std::string::npos)
              << m;
        } else {
          auto t = torch::zeros({10});
          auto m = message_of<MismatchError>([&] { comm.recv(t, 0).wait(); });
          EXPECT_NE(
              m.find("receive from rank 0 (tag 0): the message (4000 bytes, float32) is larger "
                     "than the receive buffer (40 bytes, float32)"),
              std::string::npos)
              << m;
        }
      },
      ucx());
  EXPECT_LT(seconds_since(start), 10.0) << "a mismatch must not wait for the timeout";
}

TEST(UcxEngine, ShorterMessageThanBufferFailsOnBothRanks) {
  run_ranks(
      2,
      [](Communicator& comm) {
        if (comm.rank() == 0) {
          auto t = torch::ones({4});
          comm.send(t, 1).wait();
          auto more = torch::zeros({1});
          auto m = message_of<MismatchError>([&] { comm.recv(more, 1).wait(); });
          EXPECT_NE(
              m.find(
                  "(16 bytes, float32) was shorter than its receive buffer (400 bytes, float32)"),
              std::string::npos)
              << m;
        } else {
          auto t = torch::zeros({100});
          auto m = message_of<MismatchError>([&] { comm.recv(t, 0).wait(); });
          EXPECT_NE(
              m.find("(16 bytes, float32) is shorter than the receive buffer (400 bytes, float32)"),
              std::string::npos)
              << m;
        }
      },
      ucx());
}

TEST(UcxEngine, AllReduceOfDifferentSizesFailsOnEveryRankWithoutDebugChecks) {
  const auto start = Clock::now();
  run_ranks(
      2,
      [](Communicator& comm) {
        auto t = torch::ones({comm.rank() == 0 ? 1000 : 10});
        auto m = message_of<Error>([&] { comm.all_reduce(t).wait(); });
        EXPECT_NE(m.find("the ranks called different collectives"), std::string::npos) << m;
      },
      ucx());
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(UcxEngine, ARankThatNeverSendsIsATimeoutNamingThePeer) {
  run_ranks(
      2,
      [](Communicator& comm) {
        if (comm.rank() != 0) return;
        auto t = torch::zeros({4});
        RecvOptions o;
        o.timeout = 300ms;
        auto m = message_of<TimeoutError>([&] { comm.recv(t, 1, o).wait(); });
        EXPECT_NE(m.find("receive from rank 1 (tag 0) did not complete"), std::string::npos) << m;
      },
      ucx());
}

// Rank 1 issues its part and then computes without calling cohort: rank 0's
// wait must finish while rank 1 is still computing, so the transfer moved
// without rank 1 waiting (the engine's thread progressed it).
void expect_progress_without_wait(const std::function<Work(Communicator&, torch::Tensor&)>& op) {
  std::atomic<bool> rank0_done{false};
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto t = torch::ones({4 << 20});  // 16 MiB: UCX's rendezvous protocol
        auto work = op(comm, t);
        if (comm.rank() == 0) {
          work.wait();
          rank0_done = true;
          return;
        }
        const auto until = Clock::now() + 10s;
        volatile double x = 0;
        while (!rank0_done && Clock::now() < until) x = x + 1;  // computing, no cohort call
        EXPECT_TRUE(rank0_done) << "rank 0 finished only after rank 1 waited";
        work.wait();
      },
      ucx());
}

TEST(UcxEngine, AllReduceProgressesWhileTheCallerComputes) {
  expect_progress_without_wait(
      [](Communicator& comm, torch::Tensor& t) { return comm.all_reduce(t); });
}

TEST(UcxEngine, SendProgressesWhileTheSenderComputes) {
  expect_progress_without_wait([](Communicator& comm, torch::Tensor& t) {
    return comm.rank() == 1 ? comm.send(t, 0) : comm.recv(t, 1);
  });
}

// This process's listening TCP sockets: the inodes of its socket fds that
// /proc/net/tcp{,6} lists in state LISTEN (0A).
std::set<std::string> listening_sockets() {
  std::set<std::string> ours;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (auto* e = ::readdir(d)) {
      char target[128] = {0};
      const std::string path = std::string("/proc/self/fd/") + e->d_name;
      if (::readlink(path.c_str(), target, sizeof(target) - 1) > 0 &&
          std::string(target).rfind("socket:[", 0) == 0) {
        ours.insert(std::string(target).substr(8, std::string(target).size() - 9));
      }
    }
    ::closedir(d);
  }
  std::set<std::string> listening;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string f[10];
      for (auto& x : f) fields >> x;
      if (f[3] == "0A" && ours.count(f[9])) listening.insert(f[9]);
    }
  }
  return listening;
}

TEST(UcxEngine, OneHostGroupListensOnNoSocket) {
  const auto before = listening_sockets();
  run_ranks(
      3,
      [&](Communicator& comm) {
        auto t = torch::ones({1 << 16});
        comm.all_reduce(t).wait();
        EXPECT_EQ(t[0].item<float>(), 3.0f);
        auto sub = comm.new_group({0, 2});
        if (sub) sub->barrier().wait();
        comm.barrier().wait();
        if (comm.rank() == 0) {
          EXPECT_EQ(listening_sockets(), before);
        }
        comm.barrier().wait();
      },
      ucx());
}

TEST(UcxEngine, SubgroupTagsAreTheirOwn) {
  run_ranks(
      3,
      [](Communicator& comm) {
        auto sub = comm.new_group({0, 1});
        if (comm.rank() == 2) return;
        // The same peer and tag on both communicators: each receive gets
        // its own communicator's message.
        auto a = torch::full({4}, 1.0f), b = torch::full({4}, 2.0f);
        if (comm.rank() == 0) {
          auto w1 = sub->send(b, 1);
          auto w2 = comm.send(a, 1);
          w1.wait();
          w2.wait();
        } else {
          auto in_world = torch::zeros({4}), in_sub = torch::zeros({4});
          auto w1 = comm.recv(in_world, 0);
          auto w2 = sub->recv(in_sub, 0);
          w1.wait();
          w2.wait();
          EXPECT_EQ(in_world[0].item<float>(), 1.0f);
          EXPECT_EQ(in_sub[0].item<float>(), 2.0f);
        }
      },
      ucx());
}

}  // namespace
}  // namespace cohort::testing::engine_test
