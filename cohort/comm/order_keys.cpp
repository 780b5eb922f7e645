#include "cohort/comm/order_keys.h"

#include <cstdint>
#include <cstring>
#include <limits>

namespace cohort::detail {
namespace {

// The key of a float's bits (an involution): every bit but the sign flipped
// on the negative patterns, which reverses their order.
template <typename I>
inline I flip(I bits) {
  constexpr int kSignShift = sizeof(I) * 8 - 1;
  return bits ^ ((bits >> kSignShift) & std::numeric_limits<I>::max());
}

// One pass over host memory (the reductions' buffers are contiguous): the
// tensor-op form below makes four and is several times slower per byte.
template <typename I>
void flip_host(const void* in, void* out, int64_t n, bool mark_nan, I nan_key) {
  constexpr I kInfBits = sizeof(I) == 4 ? I{0x7F800000} : static_cast<I>(0x7FF0000000000000);
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  for (int64_t i = 0; i < n; ++i) {
    I bits;
    std::memcpy(&bits, src + i * sizeof(I), sizeof(I));
    const bool nan = mark_nan && (bits & std::numeric_limits<I>::max()) > kInfBits;
    const I key = nan ? nan_key : flip(bits);
    std::memcpy(dst + i * sizeof(I), &key, sizeof(I));
  }
}

// `bits` (int32 or int64) flipped, into a new tensor; NaN patterns of
// `mark_nan` become nan_key.
template <typename I>
torch::Tensor flipped(const torch::Tensor& bits, bool mark_nan, I nan_key) {
  if (bits.device().is_cpu() && bits.is_contiguous()) {
    auto out = torch::empty_like(bits, at::MemoryFormat::Contiguous);
    flip_host<I>(bits.data_ptr(), out.data_ptr(), bits.numel(), mark_nan, nan_key);
    return out;
  }
  // On a device (NCCL's tensors): the output and a bool mask, no other
  // full-size temporary. An arithmetic shift gives all ones on negatives.
  auto out = at::__rshift__(bits, int64_t{sizeof(I) * 8 - 1});
  out.bitwise_and_(int64_t{std::numeric_limits<I>::max()}).bitwise_xor_(bits);
  if (!mark_nan) return out;
  const auto values = bits.view(sizeof(I) == 4 ? at::kFloat : at::kDouble);
  return out.masked_fill_(values.isnan(), int64_t{nan_key});
}

}  // namespace

bool reduces_as_keys(const Engine& engine, at::ScalarType dtype, ReduceOp op) {
  return !engine.propagates_nan() && (op == ReduceOp::Min || op == ReduceOp::Max) &&
         (dtype == at::kFloat || dtype == at::kDouble);
}

torch::Tensor to_order_keys(const torch::Tensor& values, ReduceOp op) {
  const bool max = op == ReduceOp::Max;
  if (values.scalar_type() == at::kDouble) {
    using L = std::numeric_limits<int64_t>;
    return flipped<int64_t>(values.view(at::kLong), true, max ? L::max() : L::min());
  }
  using I = std::numeric_limits<int32_t>;
  return flipped<int32_t>(values.view(at::kInt), true, max ? I::max() : I::min());
}

torch::Tensor order_keys_to_values(const torch::Tensor& keys) {
  if (keys.scalar_type() == at::kLong) return flipped<int64_t>(keys, false, 0).view(at::kDouble);
  return flipped<int32_t>(keys, false, 0).view(at::kFloat);
}

void order_keys_into(const torch::Tensor& keys, torch::Tensor& out) {
  const auto value_dtype = keys.scalar_type() == at::kLong ? at::kDouble : at::kFloat;
  if (out.scalar_type() == value_dtype && out.device().is_cpu() && keys.device().is_cpu() &&
      out.is_contiguous() && keys.is_contiguous()) {
    // Straight into the caller's tensor: no buffer, no copy pass.
    if (value_dtype == at::kDouble) {
      flip_host<int64_t>(keys.data_ptr(), out.data_ptr(), keys.numel(), false, 0);
    } else {
      flip_host<int32_t>(keys.data_ptr(), out.data_ptr(), keys.numel(), false, 0);
    }
    return;
  }
  out.copy_(order_keys_to_values(keys).view(out.sizes()));
}

}  // namespace cohort::detail
