// defines: the UCX engine's encodings of a collective's Signature
// (cohort/core/signature.h) on the wire: the words of a check message, and
// the tag of a small all-reduce message that is its own check.
//
// Every collective starts with a check: each rank sends its Signature to
// every other rank and receives every other rank's, so each rank compares
// all of them itself and none can finish a collective that another rank
// called differently. Check messages carry a tag of their own (kCheckBit)
// and are received whatever the rest of their tag, so a rank running another
// kind of collective, with other step tags, still meets its peers' checks,
// and the difference is named at once instead of at the timeout.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "cohort/core/signature.h"

namespace cohort::ucx {

using Kind = CollectiveKind;
using Descriptor = Signature;

// A check message: the signature as words (few: a notice carries two, and
// a message that fits in a shared-memory FIFO entry (about 100 bytes) is
// delivered even when its sender closes at once).
inline constexpr int kDescriptorWords = kSignatureWords;

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
