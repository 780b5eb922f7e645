#include "support/thread_ranks.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace cohort::testing {
namespace {

bool ranks_are_processes() {
  const char* v = std::getenv("COHORT_TEST_RANKS");
  return v && std::strcmp(v, "processes") == 0;
}

// This process is one rank of the world cohortrun started: fn runs once,
// here, on the world, which must have `size` ranks. The barrier keeps the
// ranks in step between cases (and rank 0, the store's host, until its
// peers are done with it).
void run_as_process(int size, const std::function<void(std::shared_ptr<Communicator>)>& fn,
                    const ThreadRanksOptions& options) {
  if (!cohort::is_initialized()) {
    InitOptions io;
    io.timeout = options.timeout;
    cohort::init(io);
    std::atexit([] {
      try {
        cohort::finalize();
      } catch (const std::exception&) {  // a peer that already failed: its own test says why
      }
    });
  }
  auto world = cohort::world_ptr();
  if (world->size() != size) {
    throw std::runtime_error("COHORT_TEST_RANKS=processes: this case needs " +
                             std::to_string(size) + " ranks, the world has " +
                             std::to_string(world->size()));
  }
  try {
    fn(world);
    world->barrier().wait();
  } catch (const std::exception& e) {
    throw std::runtime_error("rank " + std::to_string(world->rank()) + " of " +
                             std::to_string(size) + ": " + e.what());
  }
}

}  // namespace

void run_ranks_shared(int size,
                      const std::function<void(std::shared_ptr<Communicator>)>& fn,
                      const ThreadRanksOptions& options) {
  if (size > 1 && ranks_are_processes()) return run_as_process(size, fn, options);
  // Ranks share the process's cores; one intra-op thread each.
  torch::set_num_threads(1);
  auto store = std::make_shared<HashStore>();
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  // The order in which ranks failed: the first failure is the cause, the
  // others are usually its echo (a peer closing its connections).
  std::atomic<int> failures{0};
  std::vector<int> failed_as(static_cast<size_t>(size), size);
  // Every rank's connect() has returned (or one failed): a body that finishes
  // at once and drops its communicator would otherwise close connections a
  // slower peer is still setting up, which that peer reports as "connection
  // closed by peer" instead of the body's own result.
  std::mutex mu;
  std::condition_variable cv;
  int connected = 0;
  bool connect_failed = false;
  auto all_connected = [&](bool ok) {
    std::unique_lock<std::mutex> lock(mu);
    ++connected;
    connect_failed |= !ok;
    cv.notify_all();
    cv.wait_for(lock, options.timeout, [&] { return connected == size || connect_failed; });
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      // Outside the try: the failure is recorded before this rank's
      // connections close, so the peers' echoes come after it.
      std::shared_ptr<Communicator> comm;
      try {
        ConnectOptions co = options;
        if (options.node_of) co.node = options.node_of(r);
        // Each rank its own view of the store, as separate processes would have.
        try {
          comm = connect(std::make_shared<PrefixStore>("t", store), r, size, co);
        } catch (...) {
          all_connected(false);
          throw;
        }
        all_connected(true);
        fn(comm);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
        failed_as[static_cast<size_t>(r)] = failures++;
      }
    });
  }
  for (auto& t : threads) t.join();
  if (failures == 0) return;
  int r = 0;
  for (int i = 1; i < size; ++i)
    if (failed_as[static_cast<size_t>(i)] < failed_as[static_cast<size_t>(r)]) r = i;
  try {
    std::rethrow_exception(errors[static_cast<size_t>(r)]);
  } catch (const std::exception& e) {
    throw std::runtime_error("rank " + std::to_string(r) + " of " + std::to_string(size) +
                             " (first of " + std::to_string(failures.load()) +
                             " failed ranks): " + e.what());
  }
}

void run_ranks(int size, const std::function<void(Communicator&)>& fn,
               const ThreadRanksOptions& options) {
  // Communicators outlive every rank's body: a rank that finishes first
  // (say, its call was refused before sending) must not close connections
  // that a slower rank is still setting up. (run_ranks_shared leaves that to
  // the body, which may drop its communicator on purpose.)
  std::vector<std::shared_ptr<Communicator>> keep(static_cast<size_t>(size));
  run_ranks_shared(
      size,
      [&](std::shared_ptr<Communicator> c) {
        keep[static_cast<size_t>(c->rank())] = c;
        fn(*c);
      },
      options);
}

}  // namespace cohort::testing
