// The Worker's liveness probe: when a wait times out, it asks every peer
// whether it still answers, so the error names the rank that stopped (a
// SIGSTOP, a debugger, a hang) instead of only the neighbour this rank was
// waiting for, which may itself be waiting for the stopped one.
//
// A ping and its pong are notices on the control channel. A peer answers
// from whichever of its threads handles notices: a waiter, or the engine's
// thread between jobs (idle(), at least every 100 ms), so a rank that only
// computes still answers; a stopped process does not.
#include <limits>
#include <thread>

#include "cohort/comm/ucx/worker.h"

namespace cohort::ucx {

void Worker::answer_ping(int peer, int64_t round) {
  if (peer < 0 || peer >= size_ || peer == rank_) return;
  auto pong = at::zeros({4}, at::kLong);
  auto* w = pong.data_ptr<int64_t>();
  w[0] = kPong;
  w[1] = rank_;
  w[2] = round;
  // Not waited for: the asking rank waits for it, and close() flushes it.
  start(Channel::Control, pong, peer, 0, true);
}

void Worker::record_pong(int peer, int64_t round) {
  if (peer < 0 || peer >= size_) return;
  answered_[static_cast<size_t>(peer)].store(round, std::memory_order_release);
}

std::string Worker::probe_peers(Millis most) {
  if (size_ == 1) return "";
  const int64_t round = ++probe_round_;
  auto ping = at::zeros({4}, at::kLong);
  auto* w = ping.data_ptr<int64_t>();
  w[0] = kPing;
  w[1] = rank_;
  w[2] = round;
  std::vector<int> asked;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || closed_after(q) != std::numeric_limits<int64_t>::max()) continue;
    start(Channel::Control, ping, q, 0, true);
    asked.push_back(q);
  }
  auto silent = [&] {
    std::vector<int> s;
    for (int q : asked) {
      if (answered_[static_cast<size_t>(q)].load(std::memory_order_acquire) != round) {
        s.push_back(q);
      }
    }
    return s;
  };
  const auto until = Clock::now() + most;
  while (!silent().empty() && Clock::now() < until) {
    const bool busy = progress();
    handle_notices();
    if (!busy) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const auto quiet = silent();
  if (quiet.empty()) return asked.empty() ? "" : "; every peer still answers";
  auto list = [](const std::vector<int>& ranks) {
    std::string s = ranks.size() == 1 ? "rank " : "ranks [";
    for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
    return ranks.size() == 1 ? s : s + "]";
  };
  return "; " + list(quiet) + " did not answer within " + std::to_string(most.count()) +
         " ms: stopped (SIGSTOP, a debugger) or hung" +
         (quiet.size() < asked.size() ? ", while the other peers answered" : "");
}

}  // namespace cohort::ucx
