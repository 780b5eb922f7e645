// defines: Channel (which traffic a UCX tag carries) and Transfer (one tagged
// send or receive in flight), shared by the Worker and its parts.
//
// Locking: a Transfer's fields are written before it is posted and, for a
// receive, by UCX's completion callback (status, length, tag) before `done`
// is stored with release; a reader loads `done` with acquire first. `request`
// belongs to the Worker's in-flight list (under its lock); `verified` to the
// collective's thread. No lock of its own.
#pragma once

#include <ATen/ATen.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "cohort/core/signature.h"

namespace cohort::ucx {

using Clock = std::chrono::steady_clock;

enum class Channel : uint64_t { User = 0, Collective = 1, Control = 2 };

// A 64-bit UCX tag: the channel (2 bits), the dtype of a user message (6
// bits), the sender's rank (24 bits) and the caller's tag (32 bits).
//
// The dtype field is the message's own description, at no cost: it rides in
// the tag every message has. Receives match with it masked out (kDtypeField),
// so a message of another dtype still matches its receive, and the receiver
// compares the sender's field (ucp_tag_recv_info's sender_tag) with its own
// buffer's dtype after the match: one compare per receive. 0 is "not given"
// (the engine's collective messages, which their checks describe, and the
// control notices); else the at::ScalarType plus 1.
inline constexpr int kDtypeShift = 56;
inline constexpr int kSenderBits = 24;
inline constexpr uint64_t kDtypeField = uint64_t{63} << kDtypeShift;
// The most ranks a group's tags can name.
inline constexpr int64_t kMaxRanks = int64_t{1} << kSenderBits;

inline uint64_t tag_of(Channel channel, int sender, int tag, int dtype_code = 0) {
  return (static_cast<uint64_t>(channel) << 62) |
         (static_cast<uint64_t>(dtype_code & 63) << kDtypeShift) |
         (static_cast<uint64_t>(sender) << 32) | static_cast<uint32_t>(tag);
}
inline int sender_of(uint64_t tag) {
  return static_cast<int>((tag >> 32) & ((uint64_t{1} << kSenderBits) - 1));
}
inline int dtype_code_of(uint64_t tag) {
  return static_cast<int>((tag & kDtypeField) >> kDtypeShift);
}
// A dtype's code (0 for none: -1) and back.
inline int dtype_code(int dtype) { return dtype >= 0 && dtype < 63 ? dtype + 1 : 0; }
inline int dtype_of_code(int code) { return code - 1; }

class Worker;

struct Transfer {
  Worker* owner = nullptr;  // woken by the completion callback
  at::Tensor buffer;        // keeps the memory alive while UCX may touch it
  int peer = -1;
  int tag = 0;
  Channel channel = Channel::User;
  bool is_send = false;
  size_t bytes = 0;  // the buffer's size
  int dtype = -1;    // a user message's at::ScalarType as the caller gave it, or -1
  std::atomic<bool> done{false};
  ucs_status_t status = UCS_OK;
  size_t received = 0;      // a receive's message length
  uint64_t sender_tag = 0;  // a receive's message tag
  bool check = false;       // a receive in the check slot (collective_check.h)
  bool verified = false;    // a check compared with this rank's collective
  void* request = nullptr;  // UCX's request while not freed (Worker only)

  // "receive from rank 1 (tag 3)"
  std::string what() const;
  // A receive's sender's dtype (from its tag), or -1 when it gave none.
  int sender_dtype() const { return dtype_of_code(dtype_code_of(sender_tag)); }
};

}  // namespace cohort::ucx
