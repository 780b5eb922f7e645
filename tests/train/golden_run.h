// defines: what one rank of a Trainer golden test reports (each step's
// gradient norm and its parameters at the end) and the check of every
// rank's report against the one-process run on the whole batch.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing {

struct GoldenRun {
  std::vector<double> norms;  // per step, as the Trainer reported it
  fsdp_test::Named params;    // at the end
};

// Every one of `ranks` ranks reported `steps` norms within 1e-6 relative of
// the reference's and parameters within 1e-6 of its.
inline void expect_golden(const std::map<int, GoldenRun>& runs, const GoldenRun& ref, int ranks,
                          int steps) {
  ASSERT_EQ(runs.size(), static_cast<size_t>(ranks));
  for (const auto& [rank, run] : runs) {
    const std::string where = "rank " + std::to_string(rank);
    ASSERT_EQ(run.norms.size(), static_cast<size_t>(steps)) << where;
    for (int s = 0; s < steps; ++s) {
      EXPECT_NEAR(run.norms[s], ref.norms[s], 1e-6 * ref.norms[s]) << where << ", step " << s;
    }
    fsdp_test::expect_close(run.params, ref.params, 1e-6, where);
  }
}

}  // namespace cohort::testing
