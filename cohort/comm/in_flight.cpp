#include "cohort/comm/in_flight.h"

#include <algorithm>

namespace cohort::detail {

Access& Access::read(const std::vector<torch::Tensor>& ts) {
  for (const auto& t : ts) add(t, false);
  return *this;
}

Access& Access::write(const std::vector<torch::Tensor>& ts) {
  for (const auto& t : ts) add(t, true);
  return *this;
}

Access& Access::add(const torch::Tensor& t, bool write) {
  // What the checks refuse later (sparse, meta, no storage) or what holds
  // no bytes takes no range.
  if (!t.defined() || t.layout() != c10::kStrided || !t.has_storage() || t.is_meta() ||
      t.numel() == 0) {
    return *this;
  }
  // From the first element to the last one, strides followed (the checks
  // require contiguous tensors, but the range must hold before them).
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) return *this;
    last += (t.size(d) - 1) * t.stride(d);
  }
  const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (begin == 0) return *this;
  ranges_.push_back({begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size()), write});
  return *this;
}

bool Access::conflicts_with(const Access& earlier) const {
  for (const auto& r : ranges_) {
    for (const auto& e : earlier.ranges_) {
      if ((r.write || e.write) && r.begin < e.end && e.begin < r.end) return true;
    }
  }
  return false;
}

void InFlight::settle(const Access& access) {
  std::vector<Work> conflicting;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.empty()) return;
    for (auto& e : entries_) {
      if (e.work.finished()) continue;
      if (access.conflicts_with(e.access)) {
        conflicting.push_back(e.work);
      } else if (e.work.handles() == 1) {
        // Dropped by the caller: completed here once the engine is done.
        (void)e.work.is_completed();
      }
    }
  }
  // In issue order, outside the lock (a wait blocks). A failure stays with
  // its Work and marks the communicator failed, which refuses this call.
  for (auto& w : conflicting) {
    try {
      w.wait();
    } catch (const std::exception&) {
    }
  }
  conflicting.clear();
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& e) { return e.work.finished(); }),
                 entries_.end());
}

void InFlight::add(const Access& access, const Work& work) {
  if (work.finished()) return;
  std::lock_guard<std::mutex> lock(mu_);
  entries_.push_back({access, work});
}

std::vector<Work> InFlight::pending() {
  std::vector<Work> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& e : entries_) {
    if (!e.work.finished()) out.push_back(e.work);
  }
  return out;
}

void InFlight::drain() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& e : entries_) {
    if (!e.work.finished() && e.work.handles() == 1) (void)e.work.is_completed();
  }
  entries_.clear();
}

}  // namespace cohort::detail
