#include "cohort/expert_parallel/input_agreement.h"

#include <algorithm>
#include <vector>

#include "cohort/core/agreement.h"

namespace cohort::expert_parallel {

namespace {
constexpr int kValueShift = 32;
constexpr int64_t kRelayMask = 0xfff, kMaxValue = (int64_t{1} << 20) - 1;
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
  const auto c = t.detach().cpu().contiguous();
  std::vector<int64_t> words(c.sizes().begin(), c.sizes().end());
  words.push_back(static_cast<int64_t>(c.scalar_type()));
  words.push_back(static_cast<int64_t>(content_digest(c.data_ptr(), c.nbytes())));
  return static_cast<int64_t>(fnv1a_words(words));
}

}  // namespace cohort::expert_parallel
