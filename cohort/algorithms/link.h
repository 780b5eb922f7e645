// defines: Link, the point-to-point view every algorithm runs on (a
// PointToPoint, this operation's deadline, names for error messages), Span and
// the helpers that cut buffers into blocks and pipeline segments.
//
// Algorithms are written once over Link::send/recv, so they run on every
// engine and on a communicator's own tag space. Each wait is bounded by the
// operation's deadline; a timeout or a failed transfer is rethrown naming
// the algorithm, the step and the peer.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "cohort/core/point_to_point.h"

namespace cohort::algorithms {

using Clock = std::chrono::steady_clock;

// A run of elements of a flat buffer.
struct Span {
  int64_t offset = 0;
  int64_t count = 0;
};

// `n` elements cut into `parts` near-equal spans (the first n % parts get one
// more), so every rank computes the same layout without a message.
std::vector<Span> even_spans(int64_t n, int parts);
// `parts` spans of exactly `each` elements, back to back.
std::vector<Span> equal_spans(int64_t each, int parts);

// Messages are cut into segments of about this many bytes so that several
// are in flight and the reduction of one overlaps the transfer of the next.
inline constexpr int64_t kSegmentBytes = 1 << 20;
int64_t segment_elements(const at::Tensor& t);

// out = a op b, elementwise (out may be a). op is Sum, Min, Max or Prod.
void reduce_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b, ReduceOp op);

// Buffers an executor keeps between operations, so large temporaries are
// not allocated (and page-faulted in) on every call. Used by one thread.
class Scratch {
 public:
  // A buffer of `n` elements in slot `slot`; valid until the next call with
  // the same slot.
  at::Tensor get(int slot, int64_t n, const at::TensorOptions& options);

 private:
  std::vector<at::Tensor> slots_;
};

class Link {
 public:
  // `what` names the algorithm in messages ("ring all_reduce").
  Link(PointToPoint& transport, std::string what, Clock::time_point deadline,
       Scratch* scratch = nullptr);

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& what() const { return what_; }
  Clock::time_point deadline() const { return deadline_; }

  struct Pending {
    WorkPtr work;
    int peer = -1;
    bool is_send = false;
  };
  // Starts a transfer of `t` (a view of the caller's buffer; it must stay
  // untouched until the transfer is waited for).
  Pending send(at::Tensor t, int peer, int tag);
  Pending recv(at::Tensor t, int peer, int tag);
  // Waits until the operation's deadline; rethrows naming the peer.
  void wait(const Pending& p);
  void wait_all(std::vector<Pending>& ps);
  // Waits for an engine operation that is not a single transfer (the
  // executor's calls of its engine's own collectives).
  void wait(const WorkPtr& work, const std::string& step);
  // A temporary of `n` elements like `like` (see Scratch).
  at::Tensor scratch(int slot, int64_t n, const at::Tensor& like);

 private:
  PointToPoint& transport_;
  std::string what_;
  Clock::time_point deadline_;
  int rank_;
  int size_;
  Scratch* scratch_;
};

}  // namespace cohort::algorithms

namespace cohort::algorithms {

// One step with one peer: sends `out` and receives `in` (either may be
// empty), both cut into segments; `on_segment(offset, count)` runs as each
// received segment lands (to reduce it while the rest is on the wire).
void exchange(Link& link, int peer, const at::Tensor& out, const at::Tensor& in,
              const std::function<void(int64_t, int64_t)>& on_segment = {});

}  // namespace cohort::algorithms
