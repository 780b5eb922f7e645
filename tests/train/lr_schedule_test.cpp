#include "cohort/train/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>

#include "cohort/core/error.h"

namespace cohort::lr_schedule_test {
namespace {

TEST(LrSchedule, ConstantIsBaseLrAtEveryStep) {
  LrSchedule s;
  s.base_lr = 3e-4;
  for (int64_t step : {0, 1, 17, 100000}) EXPECT_EQ(lr_at(s, step), 3e-4);
}

TEST(LrSchedule, WarmupCosineMatchesClosedForm) {
  LrSchedule s;
  s.kind = LrScheduleKind::WarmupCosine;
  s.base_lr = 1e-3;
  s.min_lr = 1e-5;
  s.warmup_steps = 10;
  s.total_steps = 110;
  const double pi = std::acos(-1.0);
  // Warm-up: linear from base/10 at step 0 to base at step 9.
  for (int64_t t = 0; t < 10; ++t) EXPECT_DOUBLE_EQ(lr_at(s, t), 1e-3 * (t + 1) / 10.0);
  // Cosine: base at the end of warm-up, midpoint halfway, min at the end.
  EXPECT_DOUBLE_EQ(lr_at(s, 10), 1e-3);
  EXPECT_DOUBLE_EQ(lr_at(s, 60), 1e-5 + 0.5 * (1e-3 - 1e-5));
  for (int64_t t : {10, 33, 77, 109}) {
    const double p = (t - 10) / 100.0;
    EXPECT_DOUBLE_EQ(lr_at(s, t), 1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + std::cos(pi * p)));
  }
  EXPECT_DOUBLE_EQ(lr_at(s, 110), 1e-5);
  EXPECT_DOUBLE_EQ(lr_at(s, 5000), 1e-5);
}

TEST(LrSchedule, MalformedScheduleIsRefused) {
  LrSchedule s;
  s.kind = LrScheduleKind::WarmupCosine;
  s.warmup_steps = 10;
  s.total_steps = 10;
  EXPECT_THROW(lr_at(s, 0), InvalidArgument);
  s.total_steps = 20;
  EXPECT_THROW(lr_at(s, -1), InvalidArgument);
}

}  // namespace
}  // namespace cohort::lr_schedule_test
