// defines: tick_clock: the clock the per-operation counters read, cheaper
// than steady_clock where the kernel trusts the CPU's time-stamp counter.
//
// Why: every counted operation reads a clock at issue and at completion. On
// x86-64, steady_clock::now() costs about 40 ns on our VMs and the TSC
// (rdtsc) about 15 ns: at a 1 KiB MPI all_reduce of about 1.2 us the two
// reads differ by 4% of the call. The TSC is used only when the kernel's
// own clocksource is "tsc": the kernel picks it only when the counter is
// invariant and synchronized across CPUs. Otherwise a tick is a nanosecond
// of steady_clock. Ticks become nanoseconds by a rate measured once against
// steady_clock (calibrate(), about 5 ms, on the first Communicator).
#pragma once

#include <chrono>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <x86intrin.h>
#define COHORT_TICK_CLOCK_TSC 1
#else
#define COHORT_TICK_CLOCK_TSC 0
#endif

namespace cohort::tick_clock {

namespace detail {
/// Whether the kernel's clocksource is the TSC (reads sysfs).
bool kernel_uses_tsc();
/// True when now() reads the TSC, decided once.
inline bool use_tsc() {
  static const bool tsc = kernel_uses_tsc();
  return tsc;
}
/// Nanoseconds per tick, once calibrate() has run.
double ns_per_tick();
}  // namespace detail

/// A monotonic tick count; only differences mean anything.
inline uint64_t now() noexcept {
#if COHORT_TICK_CLOCK_TSC
  if (detail::use_tsc()) return __rdtsc();
#endif
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

/// Measures the tick rate if it is not known yet (thread-safe; later calls
/// return at once). Call it before timing anything that must stay cheap.
void calibrate();

/// A tick difference in nanoseconds (calibrates on first use).
inline uint64_t to_ns(uint64_t ticks) {
  return static_cast<uint64_t>(static_cast<double>(ticks) * detail::ns_per_tick());
}

/// Whether ticks are the CPU's time-stamp counter (else steady_clock nanoseconds).
inline bool reads_tsc() { return detail::use_tsc(); }

}  // namespace cohort::tick_clock
