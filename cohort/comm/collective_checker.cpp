#include "cohort/comm/collective_checker.h"

#include <map>
#include <sstream>
#include <vector>

#include "cohort/core/error.h"

namespace cohort {

namespace {
std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  if (ranks.size() == 1) {
    os << "rank " << ranks[0];
    return os.str();
  }
  os << "ranks [";
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  os << "]";
  return os.str();
}
}  // namespace

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
    throw TimeoutError("debug check of collective #" + std::to_string(seq) + " (" +
                       fingerprint + "): " + rank_list(absent) +
                       " did not reach it within " + std::to_string(timeout.count()) +
                       " ms (a different number of collectives, or a dead rank)");
  }

  // Every rank has now written `seq`, so all have finished reading seq-1:
  // this rank's old key can go.
  if (seq > 0) store_->delete_key(key(seq - 1, rank_));

  std::map<std::string, std::vector<int>> by_print;
  for (int r = 0; r < size_; ++r) {
    by_print[r == rank_ ? fingerprint : store_->get_string(keys[r])].push_back(r);
  }
  if (by_print.size() == 1) return;

  std::ostringstream os;
  os << "collective #" << seq << " differs across ranks:";
  for (auto& [print, ranks] : by_print) os << " " << rank_list(ranks) << " called " << print << ";";
  throw MismatchError(os.str());
}

}  // namespace cohort
