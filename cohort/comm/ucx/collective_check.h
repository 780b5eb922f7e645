// defines: Descriptor (what a rank calls as its n-th collective of a group)
// and its two encodings on the wire: the words of a check message, and the
// tag of a small all-reduce message that is its own check.
//
// Every collective starts with a check: each rank sends its Descriptor to
// rank + 1 and receives rank - 1's (a ring, so if any two ranks differ, some
// neighbours differ). Check messages carry a tag of their own (kCheckBit)
// and are received whatever the rest of their tag, so a rank running another
// kind of collective, with other step tags, still meets its neighbour's
// check, and the difference is named at once instead of at the timeout.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace cohort::ucx {

enum class Kind : int8_t {
  AllReduce = 1,
  Broadcast,
  Reduce,
  AllGather,
  Gather,
  Scatter,
  AllToAll,
  Barrier,
};

struct Descriptor {
  int64_t seq = 0;  // 1 for the group's first collective
  Kind kind = Kind::Barrier;
  int dtype = -1;  // at::ScalarType, or -1
  int op = -1;     // ReduceOp, or -1
  int64_t root = -1;
  int64_t bytes = -1;  // per rank; -1 where ranks may differ (all_to_all)

  bool operator==(const Descriptor& o) const {
    return seq == o.seq && kind == o.kind && dtype == o.dtype && op == o.op && root == o.root &&
           bytes == o.bytes;
  }
  bool operator!=(const Descriptor& o) const { return !(*this == o); }
  // "all_reduce (float32, 4096 bytes, sum)"
  std::string describe() const;
};

// A check message: the descriptor as words (few: a notice carries two, and
// a message that fits in a shared-memory FIFO entry (about 100 bytes) is
// delivered even when its sender closes at once).
inline constexpr int kDescriptorWords = 4;
void to_words(const Descriptor& d, int64_t* words);
Descriptor from_words(const int64_t* words);

// The low 32 bits of a check message's tag (the engine's step tags are
// non-negative ints, so they never have bit 31).
inline constexpr uint32_t kCheckBit = 1u << 31;
// Set when the message is the collective's data and the tag holds the
// whole descriptor (fused_tag), else the payload holds the words.
inline constexpr uint32_t kFusedBit = 1u << 30;

// The tag of a message that is both a small all-reduce's data and its
// check: dtype, op and size fit in the 30 bits below kFusedBit. Empty when
// they do not (then the collective sends a separate check).
std::optional<uint32_t> fused_tag(const Descriptor& d);
// The descriptor a fused tag stands for, as the seq-th collective.
Descriptor from_fused_tag(uint32_t tag, int64_t seq);

}  // namespace cohort::ucx
