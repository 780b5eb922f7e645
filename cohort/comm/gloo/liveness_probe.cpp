#include "cohort/comm/gloo/liveness_probe.h"

#include <chrono>
#include <thread>
#include <vector>

#include "cohort/core/signature.h"

namespace cohort {

namespace {

std::string mark(int64_t seq, int rank) {
  return "cohort/liveness/" + std::to_string(seq) + "/" + std::to_string(rank);
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
    // Polled rather than one wait per key: a single wait would stop at the
    // first silent rank and leave the later ones unchecked.
    const auto until = std::chrono::steady_clock::now() + most;
    while (true) {
      std::vector<int> still;
      for (int q : silent) {
        if (!store.check({mark(seq, q)})) still.push_back(q);
      }
      silent.swap(still);
      if (silent.empty()) return "; every peer still answers";
      if (std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return "; " + silent_peers_message(silent, most, "waiting for this collective");
  } catch (const std::exception& e) {
    // The store's server lives in rank 0 or the launcher: when that one is
    // the stopped process, its own timeout ends the probe.
    return std::string("; the liveness probe could not use the store (its server, in rank 0 or ") +
           "the launcher, may be the process that stopped): " + e.what();
  }
}

}  // namespace cohort
