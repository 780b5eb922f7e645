#include "cohort/comm/device_staging.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>

#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"

namespace cohort::detail {

bool on_device(const torch::Tensor& t) { return t.defined() && !t.device().is_cpu(); }

bool any_on_device(const std::vector<torch::Tensor>& ts) {
  return std::any_of(ts.begin(), ts.end(), [](const torch::Tensor& t) { return on_device(t); });
}

struct DeviceStaging::Side {
  c10::Device device;
  c10::Stream stream;
};

DeviceStaging::DeviceStaging(std::function<std::string()> where) : where_(std::move(where)) {}
DeviceStaging::~DeviceStaging() = default;

// A pool stream of t's device that starts after everything already queued
// on the caller's current stream there (the producer of t).
DeviceStaging::Side& DeviceStaging::side_for(const torch::Tensor& t) {
  for (auto& s : sides_) {
    if (s.device == t.device()) return s;
  }
  c10::impl::VirtualGuardImpl impl(t.device().type());
  const c10::Stream current = impl.getStream(t.device());
  const c10::Stream side = impl.getStreamFromGlobalPool(t.device());
  c10::Event produced(t.device().type());
  produced.record(current);
  produced.block(side);
  sides_.push_back(Side{t.device(), side});
  return sides_.back();
}

torch::Tensor DeviceStaging::stage(const torch::Tensor& t, const std::string& what, bool copy_in) {
  if (!t.defined() || t.device().is_cpu()) return t;
  // The checks a CPU tensor gets, on the caller's tensor: a staged copy
  // would hide a non-contiguous one. (Its dtype is checked on the copy.)
  if (!t.is_cuda() || t.layout() != torch::kStrided || !t.is_contiguous()) {
    check_device_tensor(t, where_(), what);
  }
  auto host = torch::empty(t.sizes(), t.options().device(torch::kCPU).pinned_memory(true));
  if (copy_in) {
    c10::StreamGuard on_side(side_for(t).stream);
    host.copy_(t.detach(), /*non_blocking=*/true);  // data, not autograd history
  }
  staged_.push_back(host);
  return host;
}

torch::Tensor DeviceStaging::read(const torch::Tensor& t, const std::string& what) {
  return stage(t, what, true);
}

torch::Tensor DeviceStaging::write(const torch::Tensor& t, const std::string& what,
                                   bool also_read) {
  auto host = stage(t, what, also_read);
  if (!host.is_same(t)) back_.emplace_back(t.detach(), host);
  return host;
}

std::vector<torch::Tensor> DeviceStaging::read(const std::vector<torch::Tensor>& ts,
                                               const std::string& what) {
  std::vector<torch::Tensor> out;
  out.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i)
    out.push_back(read(ts[i], what + "[" + std::to_string(i) + "]"));
  return out;
}

std::vector<torch::Tensor> DeviceStaging::write(const std::vector<torch::Tensor>& ts,
                                                const std::string& what) {
  std::vector<torch::Tensor> out;
  out.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i)
    out.push_back(write(ts[i], what + "[" + std::to_string(i) + "]"));
  return out;
}

void DeviceStaging::ready() {
  for (auto& s : sides_) c10::impl::VirtualGuardImpl(s.device.type()).synchronizeStream(s.stream);
}

Work DeviceStaging::finish(Work host) {
  if (staged_.empty()) return host;
  // The engines may read and write the host buffers until the operation
  // completes: they are kept until then.
  return host.then([staged = std::move(staged_), back = std::move(back_)] {
    (void)staged;
    for (const auto& [device, buffer] : back) device.copy_(buffer, /*non_blocking=*/true);
  });
}

}  // namespace cohort::detail
