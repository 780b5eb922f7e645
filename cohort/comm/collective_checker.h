// defines: CollectiveChecker, debug mode's exchange of full calls.
//
// With COHORT_DEBUG=detail every collective first publishes a fingerprint
// ("all_reduce(op=sum, dtype=float32, shape=[4, 5])") to the store and reads
// everyone else's; the one collective checker (compare_calls in
// core/signature.h, which every engine's check uses too) decides whether
// they agree and names both calls and each group of ranks. An all_to_all's
// fingerprint carries its blocks' sizes (with_blocks), which may differ by
// rank: they are checked to pair up instead. Ranks that never arrive are
// named in the timeout instead of the job hanging.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/core/store/store.h"

namespace cohort {

class CollectiveChecker {
 public:
  CollectiveChecker(std::shared_ptr<Store> store, int rank, int size);

  // An all_to_all's fingerprint: `call` (which every rank must pass alike)
  // and its blocks in elements, `sends[j]` to rank j and `expects[j]` from
  // rank j, which may differ by rank but must pair up: rank i's block to j
  // has the size j expects from i.
  static std::string with_blocks(const std::string& call, const std::vector<int64_t>& sends,
                                 const std::vector<int64_t>& expects);

  // Throws MismatchError when fingerprints differ (with_blocks: when the
  // calls differ or the blocks do not pair up, naming the first pair in rank
  // order, the same on every rank), TimeoutError naming the ranks that did
  // not arrive within `timeout`.
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
