// defines: BucketQueue, the one launch-and-wait machinery of gradient
// buckets, which DDP (all-reduce), ZeRO stage 2 (reduce-scatter into the
// shard) and the fused optimizer (all-reduce, then update) drive.
//
// Buckets are launched in one order agreed by every rank (the order is part
// of the layout), never a bucket before the ones ahead of it: so every rank
// issues the same collectives in the same order, without negotiation, as
// PyTorch's reducer does. A bucket is ready once all its parts (the
// gradients it waits for) arrived. Launched buckets are retired (waited
// for, which rethrows a failure and runs the collective's completion step)
// oldest first. The queue times each bucket from its launch to the moment
// it was first seen complete and traces it; what a bucket holds and which
// collective it runs stay with the caller.
//
// Hot path: arrive() and poll() run in gradient hooks. They allocate
// nothing, take no lock and call nothing virtual.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cohort/core/work.h"
#include "cohort/observability/trace.h"

namespace cohort {

/// Flat gradient buckets launched in one agreed order, polled, waited for,
/// timed and traced (see the file comment). One caller thread at a time.
class BucketQueue {
 public:
  /// Traces on `tracer` (null: not tracing; a communicator's tracer()):
  /// "launch bucket" spans in `category`, and each bucket's flight (launch
  /// to completion) as an async span in `flight_category`. Both must be
  /// string literals.
  BucketQueue(std::shared_ptr<Tracer> tracer, const char* category, const char* flight_category);

  /// Sets the buckets: `order` lists every bucket index once, in launch
  /// order; bucket b waits for `parts[b]` arrivals and holds `bytes[b]`
  /// bytes (for traces). Drops (does not wait for) what is in flight.
  void set_layout(std::vector<size_t> order, std::vector<int64_t> parts,
                  std::vector<int64_t> bytes);
  /// The number of buckets.
  size_t size() const { return order_.size(); }

  /// Starts an iteration: every bucket waits for all its parts again and
  /// none is launched. Drops (does not wait for) what is in flight.
  void reset();
  /// Starts the clock that launch and completion times are measured on.
  void start_clock() { start_ = Clock::now(); }
  /// Seconds since start_clock().
  double now_s() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  /// The time start_clock() was called.
  std::chrono::steady_clock::time_point start_time() const { return start_; }

  /// One part of bucket `b` arrived; true when it was the last.
  bool arrive(size_t b) { return --pending_[b] == 0; }
  /// Every bucket counts as having all its parts.
  void fill_all();
  /// Whether every bucket has been launched this iteration.
  bool all_launched() const { return next_ == order_.size(); }
  /// The next bucket to launch (not all_launched()).
  size_t next() const { return order_[next_]; }
  /// Whether the next bucket to launch has all its parts.
  bool next_ready() const { return !all_launched() && pending_[order_[next_]] <= 0; }
  /// Whether bucket `b` has been launched this iteration.
  bool launched(size_t b) const { return position_[b] < next_; }

  /// Launches the next bucket: `start(b)` issues its collective and returns
  /// its Work. Returns b.
  template <typename Start>
  size_t launch_next(Start&& start) {
    const size_t b = order_[next_];
    TraceSpan span(active(tracer_), "launch bucket", category_);
    span.arg(TraceArg::num("bucket", static_cast<double>(b)));
    launch_s_[b] = now_s();
    work_[b] = start(b);
    ++next_;
    return b;
  }
  /// Launches, in order, the buckets that are ready, up to the first that is not.
  template <typename Start>
  void launch_ready(Start&& start) {
    while (next_ready()) launch_next(start);
  }

  /// Launched and not retired yet.
  size_t in_flight() const { return next_ - retired_; }
  /// Notes when launched buckets completed, oldest first, up to the first
  /// still on the wire (a bucket is seen done at the next poll after it
  /// finished). Waits for nothing and throws nothing.
  void poll();
  /// Waits for the oldest bucket in flight (rethrowing its failure) and
  /// returns it; the queue no longer holds its Work.
  size_t retire_oldest();
  /// Retires the oldest bucket in flight if it has completed: true and its
  /// index in `b`, else false.
  bool retire_completed(size_t& b);
  /// Waits for every bucket in flight, all of them even after a failure,
  /// and returns the failures' messages (none: empty).
  std::vector<std::string> drain();

  /// Seconds (since start_clock()) during which at least one bucket
  /// retired this iteration was in flight, counting only time before
  /// `limit`: with the end of backward, the communication hidden by it.
  double busy_seconds(double limit = 1e300) const;

 private:
  using Clock = std::chrono::steady_clock;
  void mark_done(size_t b);
  void trace_flight(size_t b) const;

  std::shared_ptr<Tracer> tracer_;
  const char* category_;
  const char* flight_category_;
  std::vector<size_t> order_;     // launch position -> bucket
  std::vector<size_t> position_;  // bucket -> launch position
  std::vector<int64_t> parts_, pending_, bytes_;
  // Per bucket, this iteration: its Work until retired; launch and
  // completion times (done < 0: not seen complete yet).
  std::vector<Work> work_;
  std::vector<double> launch_s_, done_s_;
  // Launch positions: [retired_, next_) are in flight, [retired_, polled_)
  // of them seen complete.
  size_t next_ = 0, retired_ = 0, polled_ = 0;
  Clock::time_point start_ = Clock::now();
};

}  // namespace cohort
