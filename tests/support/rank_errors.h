// defines: errors_on_every_rank, which runs one function per rank (ranks as
// threads) and returns what each rank threw, for tests whose right answer is
// an exception on every rank, not only on the first one to fail.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "support/thread_ranks.h"

namespace cohort::testing {

// What a rank that threw nothing reports.
inline const std::string kNoError = "no error";

// fn(comm) on `size` ranks; element r is rank r's exception message (or
// kNoError). A rank's exception does not end the others: each is caught on
// its own rank, and every communicator stays open until all ranks are done,
// so a peer's closed connection cannot stand in for a rank's own error. The
// default timeout is short: a rank left waiting reports a timeout (which no
// test takes for the error it expects) within seconds.
inline std::vector<std::string> errors_on_every_rank(
    int size, const std::function<void(std::shared_ptr<Communicator>)>& fn,
    ThreadRanksOptions options = [] {
      ThreadRanksOptions o;
      o.timeout = std::chrono::seconds(3);
      return o;
    }()) {
  std::vector<std::string> seen(static_cast<size_t>(size), kNoError);
  std::vector<std::shared_ptr<Communicator>> keep(static_cast<size_t>(size));
  run_ranks_shared(
      size,
      [&](std::shared_ptr<Communicator> comm) {
        const auto r = static_cast<size_t>(comm->rank());
        keep[r] = comm;
        try {
          fn(comm);
        } catch (const std::exception& e) {
          seen[r] = e.what();
        }
      },
      options);
  return seen;
}

}  // namespace cohort::testing
