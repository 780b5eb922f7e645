// Order keys (cohort/comm/order_keys.h): integer order is float order, NaN
// is the extreme of its op, decoding restores every other value bit for
// bit, and the host loop agrees with the tensor-op form (strided input).
#include "cohort/comm/order_keys.h"

#include <gtest/gtest.h>

#include <limits>

namespace cohort::detail {
namespace {

torch::Tensor special_values(torch::Dtype dt) {
  const double inf = std::numeric_limits<double>::infinity();
  const double tiny = dt == torch::kFloat64 ? std::numeric_limits<double>::denorm_min()
                                            : double{std::numeric_limits<float>::denorm_min()};
  return torch::tensor({-inf, -1e30, -2.5, -1.0, -tiny, -0.0, 0.0, tiny, 1.0, 2.5, 1e30, inf},
                       torch::dtype(dt));
}

class OrderKeys : public ::testing::TestWithParam<torch::Dtype> {};

TEST_P(OrderKeys, IntegerOrderIsFloatOrder) {
  const auto v = special_values(GetParam());  // ascending, -0 before +0
  const auto keys = to_order_keys(v, ReduceOp::Min);
  EXPECT_TRUE(torch::equal(std::get<0>(keys.sort()), keys)) << keys;
  EXPECT_TRUE(keys.slice(0, 1).gt(keys.slice(0, 0, -1)).all().item<bool>()) << keys;
}

TEST_P(OrderKeys, DecodingRestoresTheBits) {
  const auto v = special_values(GetParam());
  for (auto op : {ReduceOp::Min, ReduceOp::Max}) {
    const auto back = order_keys_to_values(to_order_keys(v, op));
    EXPECT_TRUE(torch::equal(back.view(to_order_keys(v, op).scalar_type()),
                             v.view(to_order_keys(v, op).scalar_type())));
  }
}

TEST_P(OrderKeys, NaNIsTheExtremeOfItsOp) {
  const auto dt = GetParam();
  auto v = torch::cat({special_values(dt), torch::full({2}, NAN, torch::dtype(dt))});
  v[-1] = -v[-1];  // a NaN with the sign bit set
  const auto min_keys = to_order_keys(v, ReduceOp::Min);
  const auto max_keys = to_order_keys(v, ReduceOp::Max);
  EXPECT_EQ(min_keys.argmin().item<int64_t>(), v.numel() - 2);
  EXPECT_EQ(max_keys.argmax().item<int64_t>(), v.numel() - 2);
  EXPECT_TRUE(
      torch::equal(min_keys.slice(0, -2).eq(min_keys.min()), torch::ones({2}).to(torch::kBool)));
  EXPECT_TRUE(
      torch::equal(max_keys.slice(0, -2).eq(max_keys.max()), torch::ones({2}).to(torch::kBool)));
  EXPECT_TRUE(order_keys_to_values(min_keys.min().view({1})).isnan().all().item<bool>());
  EXPECT_TRUE(order_keys_to_values(max_keys.max().view({1})).isnan().all().item<bool>());
}

TEST_P(OrderKeys, HostLoopMatchesTensorOps) {
  const auto dt = GetParam();
  auto v = torch::cat({special_values(dt), torch::full({1}, NAN, torch::dtype(dt))});
  const auto strided = torch::stack({v, v}, 1).select(1, 0);  // the same values, stride 2
  ASSERT_FALSE(strided.is_contiguous());
  for (auto op : {ReduceOp::Min, ReduceOp::Max}) {
    const auto host = to_order_keys(v, op), ops = to_order_keys(strided, op);
    EXPECT_TRUE(torch::equal(host, ops)) << host << ops;
    const auto strided_keys = torch::stack({host, host}, 1).select(1, 0);
    EXPECT_TRUE(torch::equal(order_keys_to_values(host).view(host.scalar_type()),
                             order_keys_to_values(strided_keys).view(host.scalar_type())));
  }
}

INSTANTIATE_TEST_SUITE_P(Floating, OrderKeys, ::testing::Values(torch::kFloat32, torch::kFloat64));

}  // namespace
}  // namespace cohort::detail
