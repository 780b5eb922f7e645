// defines: Access (the bytes one operation reads and writes) and InFlight
// (a communicator's collectives still in flight, with their bytes), which
// orders operations on shared memory as their issue order.
//
// An operation's result lands only when its Work completes: an f16/bf16 or
// order-key reduction copies back, avg divides, a list-form gather copies
// out, and the engines may run two operations at once (Gloo's worker
// threads, MPI's nonblocking collectives). A collective issued while an
// earlier one still reads or writes the same bytes would read stale values
// or race with it. So before a call issues, the communicator completes
// (waits for, completion step included) each earlier collective of its own
// it conflicts with: write after read or write, read after write. This
// cannot deadlock: every rank issued that collective before this call, in
// the same order, so its peers are not waiting on this rank to issue it.
// Only this communicator's collectives are tracked and waited for (waiting on
// another group's, or on a point-to-point whose peer posts its side later,
// could deadlock).
//
// The list also completes collectives whose every handle was dropped: at the
// next call once the engine finished them, and at a barrier, which waits for
// every collective issued before it.
#pragma once

#include <c10/util/SmallVector.h>
#include <torch/types.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "cohort/core/work.h"

namespace cohort::detail {

/// The bytes an operation reads and writes: one range per tensor.
class Access {
 public:
  Access& read(const torch::Tensor& t) { return add(t, false); }
  Access& write(const torch::Tensor& t) { return add(t, true); }
  Access& read(const std::vector<torch::Tensor>& ts);
  Access& write(const std::vector<torch::Tensor>& ts);

  struct Range {
    uintptr_t begin;
    uintptr_t end;
    bool write;
  };
  /// Whether an operation doing `this` must wait for one doing `earlier`.
  bool conflicts_with(const Access& earlier) const;
  bool empty() const { return ranges_.empty(); }

 private:
  Access& add(const torch::Tensor& t, bool write);
  c10::SmallVector<Range, 2> ranges_;
};

/// A communicator's collectives in flight. Used from the communicator's
/// thread; a mutex keeps a Work waited for elsewhere safe.
class InFlight {
 public:
  /// Completes the tracked collectives `access` conflicts with (their errors
  /// stay with their Works, and the failed communicator refuses the call),
  /// and those the engine finished whose handles were all dropped; forgets
  /// the finished ones.
  void settle(const Access& access);
  /// Tracks a collective just issued (nothing when it is already done).
  void add(const Access& access, const Work& work);
  /// Every tracked collective not finished yet (a barrier waits for them).
  std::vector<Work> pending();
  /// Runs the completion of the dropped ones the engine finished (the
  /// communicator's destructor: nothing blocks).
  void drain();

 private:
  struct Entry {
    Access access;
    Work work;
  };
  std::mutex mu_;
  std::vector<Entry> entries_;
};

}  // namespace cohort::detail
