// The UCX engine's all-reduce on both sides of each size where its path
// changes (collectives.h): recursive doubling on raw buffers up to 64 KiB on
// power-of-two groups and up to 1 MiB at world 2 (a direct exchange), run on
// the caller's thread up to 1 MiB, the ring or halving-doubling above;
// world 1 to 4, sizes 0 and 1, every dtype the raw path reduces and one it
// leaves to the ring, sum and max.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "support/thread_ranks.h"

namespace cohort::testing::all_reduce_sizes_test {
namespace {

using Param = std::tuple<int, int64_t, torch::Dtype>;  // world, bytes, dtype

// Rank r holds (r + 1) * (i % 5 + 1) at element i: exact in every dtype
// below (at most 4 * 5 * 4 = 80 after a sum at world 4, 20 for max).
torch::Tensor pattern(int64_t n, torch::Dtype dtype) {
  return (torch::arange(n, torch::kLong) % 5 + 1).to(dtype);
}

class UcxAllReduceSizes : public ::testing::TestWithParam<Param> {};

TEST_P(UcxAllReduceSizes, SumAndMaxMatchTheClosedForm) {
  const auto [world, bytes, dtype] = GetParam();
  const int64_t n = bytes / static_cast<int64_t>(c10::elementSize(dtype));
  ThreadRanksOptions o;
  o.backend = "ucx";
  run_ranks(
      world,
      [&, n = n, dtype = dtype](Communicator& comm) {
        const auto base = pattern(n, dtype);
        const int r = comm.rank(), p = comm.size();
        for (int round = 0; round < 2; ++round) {  // the second reuses kept buffers
          auto sum = base * (r + 1);
          comm.all_reduce(sum).wait();
          auto want_sum = base * (p * (p + 1) / 2);
          EXPECT_TRUE(torch::equal(sum, want_sum)) << "sum, rank " << r << ", round " << round;
          AllReduceOptions max;
          max.op = ReduceOp::Max;
          auto top = base * (r + 1);
          comm.all_reduce(top, max).wait();
          EXPECT_TRUE(torch::equal(top, base * p)) << "max, rank " << r << ", round " << round;
        }
      },
      o);
}

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  const auto [world, bytes, dtype] = info.param;
  const std::string d = c10::toString(dtype);
  return "world" + std::to_string(world) + "_" + std::to_string(bytes) + "B_" + d;
}

// Sizes in bytes, multiples of 8 so that every dtype divides them: 0, one
// 8-byte word, each threshold and the next word above it.
INSTANTIATE_TEST_SUITE_P(
    Thresholds, UcxAllReduceSizes,
    ::testing::Combine(::testing::Values(1, 2, 3, 4),
                       ::testing::Values(int64_t{0}, int64_t{8}, int64_t{64 << 10},
                                         int64_t{(64 << 10) + 8}, int64_t{1 << 20},
                                         int64_t{(1 << 20) + 8}),
                       ::testing::Values(torch::kFloat32, torch::kFloat64, torch::kInt32,
                                         torch::kInt64, torch::kUInt8, torch::kFloat16)),
    name_of);

// One element (1 byte, 4 bytes), world 2: the smallest direct exchange.
INSTANTIATE_TEST_SUITE_P(OneElement, UcxAllReduceSizes,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Values(int64_t{4}),
                                            ::testing::Values(torch::kFloat32, torch::kInt32)),
                         name_of);

}  // namespace
}  // namespace cohort::testing::all_reduce_sizes_test
