#include "cohort/comm/ucx/collective_check.h"

#include <ATen/ATen.h>

#include "cohort/core/tensor_checks.h"
#include "cohort/core/types.h"

namespace cohort::ucx {
namespace {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::AllReduce:
      return "all_reduce";
    case Kind::Broadcast:
      return "broadcast";
    case Kind::Reduce:
      return "reduce";
    case Kind::AllGather:
      return "all_gather";
    case Kind::Gather:
      return "gather";
    case Kind::Scatter:
      return "scatter";
    case Kind::AllToAll:
      return "all_to_all";
    case Kind::Barrier:
      return "barrier";
  }
  return "an unknown collective";
}

// Fused tags: bytes in the low 21 bits, then 3 bits of op, 5 of dtype.
constexpr int kBytesBits = 21;
constexpr int kOpBits = 3;
constexpr int kDtypeBits = 5;

}  // namespace

std::string Descriptor::describe() const {
  std::string s = kind_name(kind);
  std::string args;
  auto add = [&](const std::string& a) { args += (args.empty() ? "" : ", ") + a; };
  // A peer's descriptor comes off the wire: name what is out of range as a number.
  if (dtype >= 0 && dtype < static_cast<int>(at::NumScalarTypes)) {
    add(dtype_name(static_cast<at::ScalarType>(dtype)));
  } else if (dtype >= 0) {
    add("dtype " + std::to_string(dtype));
  }
  if (bytes >= 0) add(std::to_string(bytes) + " bytes");
  if (op >= 0 && op <= static_cast<int>(ReduceOp::Prod)) {
    add(to_string(static_cast<ReduceOp>(op)));
  } else if (op >= 0) {
    add("op " + std::to_string(op));
  }
  if (root >= 0) add("root " + std::to_string(root));
  return args.empty() ? s : s + " (" + args + ")";
}

// Word 1: kind, dtype + 1 and op + 1 in a byte each (-1 is 0).
void to_words(const Descriptor& d, int64_t* w) {
  w[0] = d.seq;
  w[1] = static_cast<int64_t>(d.kind) | (int64_t{(d.dtype + 1) & 0xff} << 8) |
         (int64_t{(d.op + 1) & 0xff} << 16);
  w[2] = d.root;
  w[3] = d.bytes;
}

Descriptor from_words(const int64_t* w) {
  Descriptor d;
  d.seq = w[0];
  d.kind = static_cast<Kind>(w[1] & 0xff);
  d.dtype = static_cast<int>((w[1] >> 8) & 0xff) - 1;
  d.op = static_cast<int>((w[1] >> 16) & 0xff) - 1;
  d.root = w[2];
  d.bytes = w[3];
  return d;
}

std::optional<uint32_t> fused_tag(const Descriptor& d) {
  if (d.kind != Kind::AllReduce || d.root >= 0 || d.dtype < 0 || d.op < 0 || d.bytes < 0 ||
      d.dtype >= (1 << kDtypeBits) || d.op >= (1 << kOpBits) || d.bytes >= (1 << kBytesBits)) {
    return std::nullopt;
  }
  return kCheckBit | kFusedBit | (static_cast<uint32_t>(d.dtype) << (kBytesBits + kOpBits)) |
         (static_cast<uint32_t>(d.op) << kBytesBits) | static_cast<uint32_t>(d.bytes);
}

Descriptor from_fused_tag(uint32_t tag, int64_t seq) {
  Descriptor d;
  d.seq = seq;
  d.kind = Kind::AllReduce;
  d.bytes = tag & ((1u << kBytesBits) - 1);
  d.op = static_cast<int>((tag >> kBytesBits) & ((1u << kOpBits) - 1));
  d.dtype = static_cast<int>((tag >> (kBytesBits + kOpBits)) & ((1u << kDtypeBits) - 1));
  return d;
}

}  // namespace cohort::ucx
