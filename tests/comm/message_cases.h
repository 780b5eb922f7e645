// defines: the point-to-point message cases, written once: a receive whose
// buffer differs from the matching send in size or dtype (shorter, longer,
// another dtype of the same bytes, bfloat16 against float16, another
// element size), and run_message_case, which checks that the receiver gets
// a MismatchError naming the peer, the tag, both sizes and the dtypes the
// engine can know, within kMessageBoundSeconds (never a completed receive,
// a hang or an abort), and that the sender learns it where the engine can
// tell it. Rank 0 sends to the last rank; the others only watch. Driven by
// ranks as threads over UCX (message_test.cpp) and by mpirun over MPI
// (tests/mpi/message_world.cpp).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort::testing {

struct MessageCase {
  std::string name;  // "Shorter"
  torch::Tensor sent, buffer;
  // What every engine's receiver error says ("(16 bytes", "shorter than
  // the receive buffer (400 bytes, float32)").
  std::vector<std::string> receiver_words;
  // What an engine that carries the sender's dtype adds ("(16 bytes, float32)").
  std::vector<std::string> sender_dtype_words;
  // Only the dtype differs, not the bytes: an engine that cannot carry
  // the sender's dtype (MPI) cannot see it.
  bool same_bytes = false;
};

const std::vector<MessageCase>& message_cases();

// What an engine can tell.
struct MessageEngine {
  std::string peer_word;    // how its errors name the peer: "rank" or "peer"
  bool knows_sender_dtype;  // the message carries its dtype (UCX's tags)
  bool tells_sender;        // the sender's next wait fails too (UCX's notice)
};

// Runs `c` on this rank of `comm` (GoogleTest assertions); returns the
// seconds the receiver's (or notified sender's) error took, 0 elsewhere.
double run_message_case(Communicator& comm, const MessageCase& c, const MessageEngine& engine);

// A received message that matches its buffer arrives whole (the check
// does not refuse good messages, bfloat16 included).
void run_matching_messages(Communicator& comm);

inline constexpr auto kMessageTimeout = std::chrono::seconds(30);
inline constexpr double kMessageBoundSeconds = 5.0;
inline constexpr int kMessageTag = 7;

}  // namespace cohort::testing
