#include "support/thread_ranks.h"

#include <exception>
#include <thread>
#include <vector>

namespace cohort::testing {

void run_ranks_shared(int size,
                      const std::function<void(std::shared_ptr<Communicator>)>& fn,
                      const ThreadRanksOptions& options) {
  // Ranks share the process's cores; one intra-op thread each.
  torch::set_num_threads(1);
  auto store = std::make_shared<HashStore>();
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        ConnectOptions co = options;
        if (options.node_of) co.node = options.node_of(r);
        // Each rank its own view of the store, as separate processes would have.
        auto comm = connect(std::make_shared<PrefixStore>("t", store), r, size, co);
        fn(comm);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r) {
    if (!errors[static_cast<size_t>(r)]) continue;
    try {
      std::rethrow_exception(errors[static_cast<size_t>(r)]);
    } catch (const std::exception& e) {
      throw std::runtime_error("rank " + std::to_string(r) + " of " + std::to_string(size) +
                               ": " + e.what());
    }
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
