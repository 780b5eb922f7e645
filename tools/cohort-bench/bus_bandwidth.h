// defines: nccl-tests' bandwidth conventions, so cohort's numbers compare
// directly with theirs and with PyTorch's.
//
// algbw = bytes / time. busbw rescales it to what each link carried:
//   all_reduce       2(n-1)/n    (reduce-scatter + all-gather)
//   all_gather,
//   reduce_scatter   (n-1)/n     (bytes = the full, gathered size)
//   broadcast        1
#pragma once

#include <string>

namespace cohort::bench {

inline double bus_factor(const std::string& op, int world) {
  if (world <= 1) return 0.0;
  const double n = world;
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter") return (n - 1) / n;
  return 1.0;
}

}  // namespace cohort::bench
