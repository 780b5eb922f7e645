// defines: Tracer (one rank's timeline, written as a Chrome trace-event JSON
// file that Perfetto and chrome://tracing open), TraceArg, TraceSpan (a
// scoped complete event), active() and kTracingCompiled.
//
// Cost. A layer holds a std::shared_ptr<Tracer> that is null when tracing is
// off, and every hook is `if (Tracer* t = active(p))`: one pointer test. A
// build with -DCOHORT_TRACING=OFF makes active() return nullptr at compile
// time, so the hooks compile away. When on, an event is appended to an
// in-memory buffer under a mutex; the file is written by flush() and by the
// destructor, never on the operation's path.
//
// Memory. The buffer holds at most `max_events` events (default
// kDefaultTraceMaxEvents in core/types.h; COHORT_TRACE_MAX_EVENTS): later ones are dropped
// and counted, and the file ends with a "dropped events" record saying how
// many, so a long traced run stays bounded and says what it left out.
//
// Time. Timestamps are this process's steady clock in microseconds. Each
// rank also records its clock's offset against rank 0's (measured when the
// world communicator is built); a merger adds it to every timestamp so the
// ranks' lanes line up (tools/cohort-trace).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#ifndef COHORT_TRACING
#define COHORT_TRACING 1
#endif

namespace cohort {

/// False in a build configured with -DCOHORT_TRACING=OFF: every trace hook
/// is compiled out.
inline constexpr bool kTracingCompiled = COHORT_TRACING != 0;

/// One argument of an event ("args" in the JSON): a number or a text.
struct TraceArg {
  std::string key;        ///< the argument's name
  std::string text;       ///< its value when is_number is false
  double number = 0;      ///< its value when is_number is true
  bool is_number = true;  ///< which of number and text holds the value

  /// A numeric argument.
  static TraceArg num(std::string key, double value) { return {std::move(key), {}, value, true}; }
  /// A text argument.
  static TraceArg str(std::string key, std::string value) {
    return {std::move(key), std::move(value), 0, false};
  }
};

/// One rank's trace: events in memory, written as JSON by flush() and when
/// destroyed. Thread-safe. Build one per rank (the world Communicator does
/// when CommunicatorOptions::trace_dir is set); subgroups share it.
class Tracer {
 public:
  using Clock = std::chrono::steady_clock;  ///< the clock of every timestamp

  /// A trace of rank `rank` of `world_size`, written to `path`, keeping at
  /// most `max_events` events (0: kDefaultTraceMaxEvents).
  Tracer(int rank, int world_size, std::string path, size_t max_events = 0);
  /// Writes the file (errors go to stderr: a destructor cannot throw).
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  /// The rank whose lane this is.
  int rank() const { return rank_; }
  /// Where flush() writes.
  const std::string& path() const { return path_; }

  /// A complete event ("ph":"X") on the calling thread's lane: `name` ran
  /// from `start` to `end`. Events of one thread must nest.
  void complete(std::string name, const char* category, Clock::time_point start,
                Clock::time_point end, std::vector<TraceArg> args = {});
  /// An instant event ("ph":"i") on the calling thread's lane.
  void instant(std::string name, const char* category, Clock::time_point at,
               std::vector<TraceArg> args = {});
  /// An asynchronous span ("ph":"b" and "e" with `id`): something in flight
  /// from `start` to `end` that may overlap others (a collective between
  /// its issue and its completion). Perfetto draws it on a track of its own.
  void async_span(std::string name, const char* category, uint64_t id, Clock::time_point start,
                  Clock::time_point end, std::vector<TraceArg> args = {});

  /// Records this clock's offset against rank 0's (rank 0's time minus
  /// ours, in microseconds) and the round trip it was measured with.
  void set_clock_offset(double offset_us, double round_trip_us);
  /// Writes every event so far to path() (creating its folder). Throws
  /// Error naming the path when it cannot.
  void flush();
  /// Events recorded so far (kept, at most max_events()).
  size_t event_count() const;
  /// Events refused because max_events() were already kept.
  size_t dropped_events() const;
  /// The most events this trace keeps.
  size_t max_events() const { return max_events_; }
  /// A fresh id for async_span (unique within this trace).
  uint64_t new_id() { return next_id_.fetch_add(1, std::memory_order_relaxed) + 1; }

 private:
  struct Event {
    char phase;
    std::string name;
    const char* category;
    int64_t ts_ns;
    int64_t dur_ns;
    uint64_t id;
    int tid;
    std::vector<TraceArg> args;
  };
  void add(Event e);
  // One event as Chrome trace JSON (an async span as its begin and end).
  static void write_event(std::ostream& os, const Event& e, int pid);

  const int rank_;
  const int world_size_;
  const std::string path_;
  const size_t max_events_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
  size_t dropped_ = 0;
  int64_t first_dropped_ns_ = 0;  // the first refused event's timestamp
  double offset_us_ = 0;
  double round_trip_us_ = 0;
  std::atomic<uint64_t> next_id_{0};
};

/// `tracer` when tracing is compiled in and on, else nullptr (a constant
/// in a build without tracing).
inline Tracer* active(const std::shared_ptr<Tracer>& tracer) {
  if constexpr (kTracingCompiled) {
    return tracer.get();
  } else {
    return nullptr;
  }
}

/// A complete event from construction to destruction; does nothing when
/// `tracer` is null.
class TraceSpan {
 public:
  /// Opens the span `name` on `tracer` (may be null).
  TraceSpan(Tracer* tracer, const char* name, const char* category)
      : tracer_(tracer), name_(name), category_(category) {
    if (tracer_) start_ = Tracer::Clock::now();
  }
  /// Closes the span and records it.
  ~TraceSpan() {
    if (tracer_)
      tracer_->complete(name_, category_, start_, Tracer::Clock::now(), std::move(args_));
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

  /// Adds an argument to the event (ignored when tracing is off).
  void arg(TraceArg a) {
    if (tracer_) args_.push_back(std::move(a));
  }

 private:
  Tracer* tracer_;
  const char* name_;
  const char* category_;
  Tracer::Clock::time_point start_;
  std::vector<TraceArg> args_;
};

}  // namespace cohort
