// defines: CollectiveChecker, debug mode's exchange of full calls.
//
// With COHORT_DEBUG=detail every collective first publishes a fingerprint
// ("all_reduce(op=sum, dtype=float32, shape=[4, 5])") to the store and reads
// everyone else's; the one collective checker (compare_calls in
// core/signature.h, which every engine's check uses too) decides whether
// they agree and names both calls and each group of ranks. Ranks that never
// arrive are named in the timeout instead of the job hanging.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "cohort/core/store/store.h"

namespace cohort {

class CollectiveChecker {
 public:
  CollectiveChecker(std::shared_ptr<Store> store, int rank, int size);

  // Throws MismatchError when fingerprints differ, TimeoutError naming the
  // ranks that did not arrive within `timeout`.
  void verify(const std::string& fingerprint, Millis timeout);

 private:
  std::string key(uint64_t seq, int rank) const;

  std::shared_ptr<Store> store_;
  int rank_;
  int size_;
  std::mutex mu_;
  uint64_t seq_ = 0;
};

}  // namespace cohort
