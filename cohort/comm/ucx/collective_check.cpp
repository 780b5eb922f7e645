#include "cohort/comm/ucx/collective_check.h"

namespace cohort::ucx {
namespace {

// Fused tags: elements in the low 21 bits, then 3 bits of op, 5 of dtype.
constexpr int kCountBits = 21;
constexpr int kOpBits = 3;
constexpr int kDtypeBits = 5;

}  // namespace

std::optional<uint32_t> fused_tag(const Descriptor& d) {
  if (d.kind != Kind::AllReduce || d.root >= 0 || d.dtype < 0 || d.op < 0 || d.count < 0 ||
      d.dtype >= (1 << kDtypeBits) || d.op >= (1 << kOpBits) || d.count >= (1 << kCountBits)) {
    return std::nullopt;
  }
  return kCheckBit | kFusedBit | (static_cast<uint32_t>(d.dtype) << (kCountBits + kOpBits)) |
         (static_cast<uint32_t>(d.op) << kCountBits) | static_cast<uint32_t>(d.count);
}

Descriptor from_fused_tag(uint32_t tag, int64_t seq) {
  Descriptor d;
  d.seq = seq;
  d.kind = Kind::AllReduce;
  d.count = tag & ((1u << kCountBits) - 1);
  d.op = static_cast<int>((tag >> kCountBits) & ((1u << kOpBits) - 1));
  d.dtype = static_cast<int>((tag >> (kCountBits + kOpBits)) & ((1u << kDtypeBits) - 1));
  return d;
}

}  // namespace cohort::ucx
