#include "cohort/grad_sync/bucket_queue.h"

#include <algorithm>

#include "cohort/core/error.h"

namespace cohort {

BucketQueue::BucketQueue(std::shared_ptr<Tracer> tracer, const char* category,
                         const char* flight_category)
    : tracer_(std::move(tracer)), category_(category), flight_category_(flight_category) {}

void BucketQueue::set_layout(std::vector<size_t> order, std::vector<int64_t> parts,
                             std::vector<int64_t> bytes) {
  const size_t n = order.size();
  COHORT_CHECK(parts.size() == n && bytes.size() == n, "bucket layout sizes differ");
  position_.assign(n, n);
  for (size_t k = 0; k < n; ++k) {
    COHORT_CHECK(order[k] < n && position_[order[k]] == n, "bucket order is not a permutation");
    position_[order[k]] = k;
  }
  order_ = std::move(order);
  parts_ = std::move(parts);
  bytes_ = std::move(bytes);
  work_.assign(n, Work());
  launch_s_.assign(n, 0.0);
  done_s_.assign(n, -1.0);
  pending_ = parts_;
  next_ = retired_ = polled_ = 0;
}

void BucketQueue::reset() {
  pending_ = parts_;
  for (size_t k = retired_; k < next_; ++k) work_[order_[k]] = Work();
  std::fill(done_s_.begin(), done_s_.end(), -1.0);
  next_ = retired_ = polled_ = 0;
}

void BucketQueue::fill_all() { std::fill(pending_.begin(), pending_.end(), 0); }

void BucketQueue::mark_done(size_t b) {
  if (done_s_[b] < 0) done_s_[b] = now_s();
}

void BucketQueue::poll() {
  polled_ = std::max(polled_, retired_);
  while (polled_ < next_ && work_[order_[polled_]].is_completed()) mark_done(order_[polled_++]);
}

size_t BucketQueue::retire_oldest() {
  COHORT_CHECK(retired_ < next_, "no bucket in flight");
  const size_t b = order_[retired_++];
  // Dropped before the caller reuses the bucket's memory: a finished
  // collective's hold on it. A failed wait drops it too.
  Work work = std::move(work_[b]);
  work.wait();
  mark_done(b);
  trace_flight(b);
  return b;
}

bool BucketQueue::retire_completed(size_t& b) {
  if (retired_ == next_ || !work_[order_[retired_]].is_completed()) return false;
  b = retire_oldest();
  return true;
}

std::vector<std::string> BucketQueue::drain() {
  std::vector<std::string> failures;
  while (retired_ < next_) {
    try {
      retire_oldest();
    } catch (const std::exception& e) {
      failures.emplace_back(e.what());
    }
  }
  return failures;
}

void BucketQueue::trace_flight(size_t b) const {
  Tracer* t = active(tracer_);
  if (!t) return;
  auto at = [&](double s) {
    return start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  t->async_span("bucket " + std::to_string(b), flight_category_, t->new_id(), at(launch_s_[b]),
                at(done_s_[b]),
                {TraceArg::num("bucket", static_cast<double>(b)),
                 TraceArg::num("bytes", static_cast<double>(bytes_[b]))});
}

double BucketQueue::busy_seconds(double limit) const {
  std::vector<std::pair<double, double>> spans;
  spans.reserve(retired_);
  for (size_t k = 0; k < retired_; ++k)
    spans.emplace_back(launch_s_[order_[k]], done_s_[order_[k]]);
  std::sort(spans.begin(), spans.end());
  double total = 0, cur_start = 0, cur_end = -1;
  auto flush = [&] {
    if (cur_end > cur_start)
      total += std::max(0.0, std::min(cur_end, limit) - std::min(cur_start, limit));
  };
  for (auto [s, e] : spans) {
    if (s > cur_end) {
      flush();
      cur_start = s;
      cur_end = e;
    } else {
      cur_end = std::max(cur_end, e);
    }
  }
  flush();
  return total;
}

}  // namespace cohort
