// main() of the test binaries whose ranks are processes, started by
// `mpirun -np N` or `cohortrun -n N`: cohort::init() finds MPI or the torchrun
// environment by itself, every test uses world(), and only rank 0 prints
// GoogleTest's report (other ranks print their failures, prefixed with their
// rank). Any rank's failure is its exit status, so the launcher fails too.
#include <gtest/gtest.h>

#include <cstdio>
#include <exception>

#include "cohort/cohort.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                 r.line_number(), r.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  torch::set_num_threads(1);
  cohort::InitOptions options;
  // A test that fails on one rank leaves the others waiting: they fail
  // after this, never hang.
  options.timeout = std::chrono::seconds(20);
  auto world = cohort::init(options);
  if (world->rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world->rank()));
  }
  int rc = RUN_ALL_TESTS();
  // Rank 0 hosts the store: if it left first, a peer still reading the
  // store in its last test (a debug check reads every rank's key) would
  // fail on a closed connection. The barrier keeps rank 0 until all are done.
  try {
    world->barrier().wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] final barrier: %s\n", world->rank(), e.what());
    rc = 1;
  }
  if (rc != 0) std::fprintf(stderr, "[rank %d] FAILED\n", world->rank());
  cohort::finalize();
  return rc;
}
