#include "cohort/expert_parallel/input_agreement.h"

#include <algorithm>
#include <array>
#include <vector>

#include "cohort/core/agreement.h"

namespace cohort::expert_parallel {

namespace {
constexpr int kValueShift = 32;
constexpr int64_t kRelayMask = 0xfff, kMaxValue = (int64_t{1} << 20) - 1;
// Mixing constants (the golden ratio's and MurmurHash3's finalizer's).
constexpr int64_t kMultiplier1 = static_cast<int64_t>(0x9E3779B97F4A7C15ULL);
constexpr int64_t kMultiplier2 = static_cast<int64_t>(0xC2B2AE3D27D4EB4FULL);
}  // namespace

int64_t refusal_word(Refusal kind, int64_t value) {
  return kind + std::min(value, kMaxValue) * (int64_t{1} << kValueShift);
}

int64_t relayed(int64_t word, int rank, int shift) {
  return word + std::min<int64_t>(rank + 1, kRelayMask) * (int64_t{1} << shift);
}

int relayed_from(int64_t word, int shift) {
  return static_cast<int>((word >> shift) & kRelayMask) - 1;
}

std::string refusal_text(int64_t word, int64_t hidden, c10::ScalarType dtype) {
  const int64_t value = word >> kValueShift;  // arithmetic: a negative value stays negative
  const std::string tp_rank = "tp rank 0's and tp rank " + std::to_string(value) + "'s differ";
  switch (word & 255) {
    case kWidth:
      return "the input's last dimension must be hidden = " + std::to_string(hidden) + ", got " +
             (value < 0            ? std::string("a 0-dimensional input")
              : value == kMaxValue ? "at least " + std::to_string(value)
                                   : std::to_string(value));
    case kDtype:
      return std::string("the input is ") + c10::toString(static_cast<c10::ScalarType>(value)) +
             ", the MoE's parameters " + c10::toString(dtype) +
             " (convert one to the other: the router and experts take the input as it is)";
    case kTpInput:
      return "the ranks of its tensor-parallel group hold different inputs (" + tp_rank +
             "): every TP rank must hold the same tokens, which it routes alike and whose "
             "partial outputs are summed over tp";
    default:
      return "the ranks of its tensor-parallel group hold different routers (" + tp_rank +
             "): the router is replicated over tp, and its TP ranks must route alike";
  }
}

int64_t merged(int64_t flags, int64_t peer) {
  const int64_t no_grad = (peer & (kNoGradMode | kPeerNoGradMode)) ? int64_t{kPeerNoGradMode} : 0;
  return flags | (peer & (kRecords | kInputGrad)) | no_grad;
}

int64_t tensor_digest(const torch::Tensor& t) {
  const auto c = t.detach().contiguous();
  std::vector<int64_t> words(c.sizes().begin(), c.sizes().end());
  words.push_back(static_cast<int64_t>(c.scalar_type()));
  if (c.device().is_cpu()) {
    words.push_back(static_cast<int64_t>(content_digest(c.data_ptr(), c.nbytes())));
  } else {
    const auto lanes = device_content_digest(c);
    words.insert(words.end(), lanes.begin(), lanes.end());
  }
  return static_cast<int64_t>(fnv1a_words(words));
}

std::array<int64_t, 2> device_content_digest(const torch::Tensor& t) {
  // The bytes as integers of the element's width (two int64 for a 16-byte
  // element), widened to int64 a slice at a time so the temporaries stay
  // bounded whatever the input's size.
  const auto flat = t.detach().contiguous().reshape({-1});
  const auto width = flat.element_size();
  const auto as = width == 1   ? torch::kUInt8
                  : width == 2 ? torch::kInt16
                  : width == 4 ? torch::kInt32
                               : torch::kInt64;
  const auto ints = flat.view(as);
  constexpr int64_t kSlice = int64_t{1} << 22;
  const auto index = torch::TensorOptions().dtype(torch::kInt64).device(t.device());
  auto sums = torch::zeros({2}, index);
  for (int64_t start = 0; start < ints.numel(); start += kSlice) {
    const int64_t n = std::min(kSlice, ints.numel() - start);
    const auto w = ints.narrow(0, start, n).to(torch::kInt64);
    const auto pos = torch::arange(start, start + n, index);
    // Odd multipliers are invertible modulo 2^64, so a change of one word
    // always changes both sums; the wrap-around of int64 arithmetic is the
    // modulus, and integer sums are exact in any order.
    const auto m1 = torch::bitwise_or(pos * kMultiplier1 + kMultiplier2, 1);
    const auto m2 = torch::bitwise_or(torch::bitwise_xor(pos, kMultiplier1) * kMultiplier2, 1);
    sums += torch::stack({(w * m1).sum(), (w * m2).sum()});
  }
  const auto host = sums.cpu();
  return {host[0].item<int64_t>(), host[1].item<int64_t>()};
}

}  // namespace cohort::expert_parallel
