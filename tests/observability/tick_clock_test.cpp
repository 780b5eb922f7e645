// tick_clock against steady_clock: its ticks, converted, measure the same
// intervals, and it never runs backwards on one thread.
#include "cohort/observability/tick_clock.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>

namespace cohort::tick_clock_test {
namespace {

using Steady = std::chrono::steady_clock;

// Busy for about `ms` so that the interval is long against the clocks' read
// costs; returns the interval on both clocks, in nanoseconds.
std::pair<double, double> interval_ns(int ms) {
  const uint64_t t0 = tick_clock::now();
  const auto s0 = Steady::now();
  while (Steady::now() - s0 < std::chrono::milliseconds(ms)) {
  }
  const auto s1 = Steady::now();
  const uint64_t t1 = tick_clock::now();
  return {static_cast<double>(tick_clock::to_ns(t1 - t0)),
          std::chrono::duration<double, std::nano>(s1 - s0).count()};
}

TEST(TickClock, ConvertedTicksMeasureWhatSteadyClockMeasures) {
  tick_clock::calibrate();
  for (int ms : {2, 20}) {
    // The tick reads bracket the steady reads, so the tick interval is the
    // longer by a few hundred ns, or by a host stall between the reads; the
    // least ratio of five tries has neither. A wrong rate shows in it.
    double least = 1e9;
    for (int i = 0; i < 5; ++i) {
      auto [ticks_ns, steady_ns] = interval_ns(ms);
      least = std::min(least, ticks_ns / steady_ns);
    }
    EXPECT_NEAR(least, 1.0, 1e-3) << ms << " ms, reads the TSC: " << tick_clock::reads_tsc();
  }
}

TEST(TickClock, NeverRunsBackwardsOnOneThread) {
  uint64_t last = tick_clock::now();
  for (int i = 0; i < 100000; ++i) {
    const uint64_t t = tick_clock::now();
    ASSERT_GE(t, last) << "read " << i;
    last = t;
  }
}

TEST(TickClock, ZeroTicksAreZeroNanoseconds) { EXPECT_EQ(tick_clock::to_ns(0), 0u); }

}  // namespace
}  // namespace cohort::tick_clock_test
