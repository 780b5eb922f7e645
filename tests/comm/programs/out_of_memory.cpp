// One rank of the out-of-memory test (tests/comm/out_of_memory_test.cpp),
// started by cohortrun. After init() the rank caps its own data segment
// (setrlimit(RLIMIT_DATA)) at what it uses now + 64 MiB, then trains as a
// DDP step would: a matrix product and an all_reduce each step, keeping
// every result, until an allocation fails. It must fail with the allocation
// named (exit 3), never hang: the first matrix product under the cap needs
// OpenBLAS's workspace (128 MiB, more than the headroom), which OpenBLAS
// 0.3.21 retries forever when it cannot be mapped.
#include <sys/resource.h>

#include <cstdio>
#include <fstream>
#include <new>
#include <string>
#include <vector>

#include "cohort/cohort.h"
#include "comm/programs/programs.h"

namespace cohort::testing::programs {

namespace {

// VmData of /proc/self/status, in bytes: what RLIMIT_DATA counts.
long long data_segment_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  long long kib = 0;
  while (status >> key) {
    if (key == "VmData:") {
      status >> kib;
      return kib * 1024;
    }
    status.ignore(1 << 16, '\n');
  }
  throw std::runtime_error("out_of_memory: no VmData in /proc/self/status");
}

void cap_data_segment(long long headroom) {
  rlimit limit{};
  ::getrlimit(RLIMIT_DATA, &limit);
  limit.rlim_cur = static_cast<rlim_t>(data_segment_bytes() + headroom);
  if (::setrlimit(RLIMIT_DATA, &limit) != 0) throw std::runtime_error("setrlimit(RLIMIT_DATA)");
}

}  // namespace

int out_of_memory(int argc, char** argv) {
  int rank = -1;
  try {
    auto comm = cohort::init();
    rank = comm->rank();
    cap_data_segment(64ll << 20);
    auto w = torch::randn({512, 512});
    std::vector<torch::Tensor> held;  // 2 MiB more each step
    for (int step = 0; step < 4096; ++step) {
      auto y = torch::mm(torch::randn({1024, 512}), w);
      comm->all_reduce(y).wait();
      held.push_back(y);
    }
    std::fprintf(stderr, "rank %d: 8 GiB allocated under a 64 MiB cap\n", rank);
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "rank %d out of memory: %s\n", rank, e.what_without_backtrace());
    return 3;
  } catch (const std::bad_alloc& e) {
    std::fprintf(stderr, "rank %d out of memory: std::bad_alloc\n", rank);
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d failed otherwise: %s\n", rank, e.what());
    return 2;
  }
}

}  // namespace cohort::testing::programs
