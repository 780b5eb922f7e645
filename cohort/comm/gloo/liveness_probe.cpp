#include "cohort/comm/gloo/liveness_probe.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>
#include <vector>

#include "cohort/core/signature.h"

namespace cohort {

namespace {

std::string mark(int64_t seq, int rank, const char* what = "") {
  return "cohort/liveness/" + std::to_string(seq) + "/" + std::to_string(rank) + what;
}

// The ranks of `peers` without `what`'s mark for `seq`.
std::vector<int> unmarked(Store& store, const std::vector<int>& peers, int64_t seq,
                          const char* what) {
  std::vector<int> still;
  for (int q : peers) {
    if (!store.check({mark(seq, q, what)})) still.push_back(q);
  }
  return still;
}

using Clock = std::chrono::steady_clock;

// Marks this rank's probe done, then waits until every rank that marked
// itself alive has marked done too: a peer first seen alive at time t ends
// its own probe by t + `most` (its window), so it is waited for until then
// and a second more (a loaded machine's scheduling); 3 * `most` + 1 s at
// most in all. Why: the store's server may live in this process (rank 0 under
// torchrun's variables), and a survivor that reports its error usually
// exits; leaving before the other survivors have read the marks would cut
// their probe off ("Connection reset") and leave them without a name. A
// peer's verdict is made before it marks done, so the store may go away
// during this wait (its host saw every mark and left): that ends it.
void wait_for_answering_probes(Store& store, int rank, int size, int64_t seq, Millis most,
                               std::map<int, Clock::time_point> seen, Clock::time_point start) {
  store.set(mark(seq, rank, "/done"), {1});
  std::vector<int> peers;
  for (int q = 0; q < size; ++q) {
    if (q != rank) peers.push_back(q);
  }
  const auto cap = start + 3 * most + std::chrono::seconds(1);
  while (Clock::now() < cap) {
    // Re-read each round: a rank whose timeout came later marks itself alive
    // after this one's window ended, and still reads the marks through here.
    auto until = Clock::time_point::min();
    for (int q : unmarked(store, peers, seq, "/done")) {
      if (!seen.count(q) && store.check({mark(seq, q)})) seen[q] = Clock::now();
      if (seen.count(q)) until = std::max(until, seen[q] + most + std::chrono::seconds(1));
    }
    if (Clock::now() >= until) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

std::string store_liveness_probe(Store& store, int rank, int size, int64_t seq, Millis most) {
  if (size <= 1 || seq <= 0) return "";
  try {
    store.set(mark(seq, rank), {1});
    std::vector<int> silent;
    for (int q = 0; q < size; ++q) {
      if (q != rank) silent.push_back(q);
    }
    std::map<int, Clock::time_point> seen;  // when each peer's mark was first read
    // Polled rather than one wait per key: a single wait would stop at the
    // first silent rank and leave the later ones unchecked.
    const auto start = Clock::now();
    while (true) {
      const auto still = unmarked(store, silent, seq, "");
      for (int q : silent) {
        if (!std::count(still.begin(), still.end(), q)) seen[q] = Clock::now();
      }
      silent = still;
      if (silent.empty() || Clock::now() >= start + most) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    try {
      wait_for_answering_probes(store, rank, size, seq, most, std::move(seen), start);
    } catch (const std::exception&) {
      // The verdict above stands: the host left once every probe was done.
    }
    if (silent.empty()) return "; every peer still answers";
    return "; " + silent_peers_message(silent, most, "waiting for this collective");
  } catch (const std::exception& e) {
    // The store's server lives in rank 0 or the launcher: when that one is
    // the stopped process, its own timeout ends the probe.
    return std::string("; the liveness probe could not use the store (its server, in rank 0 or ") +
           "the launcher, may be the process that stopped): " + e.what();
  }
}

}  // namespace cohort
