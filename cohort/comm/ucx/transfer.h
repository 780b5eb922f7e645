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

namespace cohort::ucx {

using Clock = std::chrono::steady_clock;

enum class Channel : uint64_t { User = 0, Collective = 1, Control = 2 };

// A 64-bit UCX tag: the channel (2 bits), the sender's rank (30 bits) and
// the caller's tag (32 bits).
inline uint64_t tag_of(Channel channel, int sender, int tag) {
  return (static_cast<uint64_t>(channel) << 62) | (static_cast<uint64_t>(sender) << 32) |
         static_cast<uint32_t>(tag);
}

class Worker;

struct Transfer {
  Worker* owner = nullptr;  // woken by the completion callback
  at::Tensor buffer;        // keeps the memory alive while UCX may touch it
  int peer = -1;
  int tag = 0;
  Channel channel = Channel::User;
  bool is_send = false;
  size_t bytes = 0;  // the buffer's size
  std::atomic<bool> done{false};
  ucs_status_t status = UCS_OK;
  size_t received = 0;      // a receive's message length
  uint64_t sender_tag = 0;  // a receive's message tag
  bool check = false;       // a receive in the check slot (collective_check.h)
  bool verified = false;    // a check compared with this rank's collective
  void* request = nullptr;  // UCX's request while not freed (Worker only)

  // "receive from rank 1 (tag 3)"
  std::string what() const;
};

}  // namespace cohort::ucx
