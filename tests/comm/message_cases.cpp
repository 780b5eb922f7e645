#include "tests/comm/message_cases.h"

#include <gtest/gtest.h>

#include "cohort/core/error.h"

namespace cohort::testing {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

const std::vector<MessageCase>& message_cases() {
  static const std::vector<MessageCase> cases = {
      {"Shorter",
       torch::ones({4}),
       torch::zeros({100}),
       {"(16 bytes", "is shorter than the receive buffer (400 bytes, float32)"},
       {"(16 bytes, float32)"}},
      {"Longer",
       torch::ones({1000}),
       torch::zeros({10}),
       {"is larger than the receive buffer (40 bytes, float32)"},
       {"(4000 bytes, float32)"}},
      {"SameBytesOtherDtype",
       torch::ones({10}, torch::kInt32),
       torch::zeros({10}),
       {"(40 bytes, int32) is of another dtype than the receive buffer (40 bytes, float32)"},
       {},
       true},
      {"BFloat16AsFloat16",
       torch::ones({8}, torch::kBFloat16),
       torch::zeros({8}, torch::kFloat16),
       {"(16 bytes, bfloat16) is of another dtype than the receive buffer (16 bytes, float16)"},
       {},
       true},
      {"OtherElementSize",
       torch::ones({2}, torch::kFloat64),
       torch::zeros({5}),
       {"(16 bytes", "is shorter than the receive buffer (20 bytes, float32)"},
       {"(16 bytes, float64)"}},
  };
  return cases;
}

double run_message_case(Communicator& comm, const MessageCase& c, const MessageEngine& engine) {
  const int sender = 0, receiver = comm.size() - 1;
  const auto start = Clock::now();
  if (comm.rank() == sender) {
    auto sent = c.sent.clone();
    comm.send(sent, receiver, {kMessageTag}).wait();
    if (!engine.tells_sender) return 0;
    // The receiver's notice fails this rank's next wait.
    auto more = torch::zeros({1});
    try {
      comm.recv(more, receiver, {kMessageTag + 1}).wait();
      ADD_FAILURE() << c.name << ": the sender was not told";
    } catch (const MismatchError& e) {
      const std::string m = e.what();
      EXPECT_TRUE(has(m, "send to " + engine.peer_word + " " + std::to_string(receiver) + " (tag " +
                             std::to_string(kMessageTag) + ")"))
          << m;
      EXPECT_TRUE(has(m, "rank " + std::to_string(receiver) + " reports the message")) << m;
    } catch (const std::exception& e) {
      ADD_FAILURE() << c.name << ": the sender got another error: " << e.what();
    }
    return seconds_since(start);
  }
  if (comm.rank() != receiver) return 0;
  auto buffer = c.buffer.clone();
  if (c.same_bytes && !engine.knows_sender_dtype) {
    // The engine cannot see it (its README says so): the bytes arrive.
    comm.recv(buffer, sender, {kMessageTag}).wait();
    return 0;
  }
  try {
    comm.recv(buffer, sender, {kMessageTag}).wait();
    ADD_FAILURE() << c.name << ": the receive completed";
  } catch (const MismatchError& e) {
    const std::string m = e.what();
    EXPECT_TRUE(has(m, engine.peer_word + " " + std::to_string(sender))) << m;
    EXPECT_TRUE(has(m, "tag " + std::to_string(kMessageTag))) << m;
    for (const auto& w : c.receiver_words) EXPECT_TRUE(has(m, w)) << "'" << w << "' in " << m;
    if (engine.knows_sender_dtype) {
      for (const auto& w : c.sender_dtype_words) EXPECT_TRUE(has(m, w)) << "'" << w << "' in " << m;
    }
    // The Communicator names the operation and this rank.
    EXPECT_TRUE(
        has(m, "recv on rank " + std::to_string(receiver) + " of " + std::to_string(comm.size())))
        << m;
  } catch (const std::exception& e) {
    ADD_FAILURE() << c.name << ": not a MismatchError: " << e.what();
  }
  const double s = seconds_since(start);
  EXPECT_LT(s, kMessageBoundSeconds) << c.name << ": waited for the timeout";
  return s;
}

void run_matching_messages(Communicator& comm) {
  const int sender = 0, receiver = comm.size() - 1;
  for (auto dtype : {torch::kFloat32, torch::kInt32, torch::kBFloat16, torch::kFloat16}) {
    auto sent = torch::arange(6).to(dtype);
    if (comm.rank() == sender) comm.send(sent, receiver, {kMessageTag}).wait();
    if (comm.rank() == receiver) {
      auto got = torch::zeros({6}, dtype);
      comm.recv(got, sender, {kMessageTag}).wait();
      EXPECT_TRUE(torch::equal(got, sent)) << dtype;
    }
  }
}

}  // namespace cohort::testing
