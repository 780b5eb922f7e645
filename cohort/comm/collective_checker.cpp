#include "cohort/comm/collective_checker.h"

#include <vector>

#include "cohort/core/error.h"
#include "cohort/core/signature.h"

namespace cohort {

CollectiveChecker::CollectiveChecker(std::shared_ptr<Store> store, int rank, int size)
    : store_(std::move(store)), rank_(rank), size_(size) {}

std::string CollectiveChecker::key(uint64_t seq, int rank) const {
  return "debug/" + std::to_string(seq) + "/" + std::to_string(rank);
}

void CollectiveChecker::verify(const std::string& fingerprint, Millis timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t seq = seq_++;
  store_->set_string(key(seq, rank_), fingerprint);

  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back(key(seq, r));
  try {
    store_->wait(keys, timeout);
  } catch (const TimeoutError&) {
    std::vector<int> absent;
    for (int r = 0; r < size_; ++r) {
      if (!store_->check({keys[r]})) absent.push_back(r);
    }
    throw TimeoutError("debug check of collective #" + std::to_string(seq) + " (" + fingerprint +
                       "): " + name_ranks(absent) + " did not reach it within " +
                       std::to_string(timeout.count()) +
                       " ms (a different number of collectives, or a dead rank)");
  }

  // Every rank has now written `seq`, so all have finished reading seq-1:
  // this rank's old key can go.
  if (seq > 0) store_->delete_key(key(seq - 1, rank_));

  // The one collective checker (core/signature.h) decides and words it.
  std::vector<std::string> calls;
  for (int r = 0; r < size_; ++r) {
    calls.push_back(r == rank_ ? fingerprint : store_->get_string(keys[r]));
  }
  const std::string differs = compare_calls("debug check", static_cast<int64_t>(seq), rank_, calls);
  if (!differs.empty()) throw MismatchError(differs);
}

}  // namespace cohort
