// defines: DeviceStaging, how a Communicator carries CUDA tensors over the
// engines, which move host memory. Each CUDA tensor of an operation is
// copied into a pinned host buffer, the operation runs on the host buffers
// as on any CPU tensors (checks, algorithms and engines alike), and the
// buffers it writes are copied back when its Work completes.
//
// The copy in runs on a stream of its own that first waits for the
// caller's current stream, so whatever produced the tensor is finished
// first, and the caller's stream is not held up; the issuing thread waits
// for that copy alone. The copy back is enqueued on the waiting thread's
// current stream once the transport finished, without the host waiting
// for it: as after c10d's wait() on NCCL, later work on that stream sees
// the result. The pinned buffers come from LibTorch's caching host
// allocator, which keeps each one until the copies that use it are done.
//
// Written against c10's device-generic streams and events, so this file
// compiles in every build; it runs only where LibTorch has CUDA.
#pragma once

#include <torch/types.h>

#include <functional>
#include <string>
#include <vector>

#include "cohort/core/work.h"

namespace cohort::detail {

/// Whether `t` lives on a device (is defined and not a CPU tensor).
bool on_device(const torch::Tensor& t);
/// Whether any of `ts` does.
bool any_on_device(const std::vector<torch::Tensor>& ts);

/// The host side of one operation's device tensors (see the file comment).
/// `where` describes the operation for a refused tensor's message (built
/// only then).
class DeviceStaging {
 public:
  explicit DeviceStaging(std::function<std::string()> where);
  ~DeviceStaging();
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;

  /// A host tensor holding `t`'s values (`t` itself when on the CPU).
  torch::Tensor read(const torch::Tensor& t, const std::string& what);
  /// A host tensor the operation writes, copied into `t` when it
  /// completes; holding `t`'s values first when `also_read` (in place).
  torch::Tensor write(const torch::Tensor& t, const std::string& what, bool also_read = false);
  std::vector<torch::Tensor> read(const std::vector<torch::Tensor>& ts, const std::string& what);
  std::vector<torch::Tensor> write(const std::vector<torch::Tensor>& ts, const std::string& what);

  /// Waits for the copies in: call after the last read/write and before
  /// the operation is issued on the host tensors.
  void ready();
  /// `host` (the operation on the host tensors), then the copies back.
  Work finish(Work host);

 private:
  struct Side;  // a device's copy stream
  Side& side_for(const torch::Tensor& t);
  torch::Tensor stage(const torch::Tensor& t, const std::string& what, bool copy_in);

  std::function<std::string()> where_;
  std::vector<Side> sides_;
  std::vector<torch::Tensor> staged_;  // every host buffer, alive until the Work completes
  std::vector<std::pair<torch::Tensor, torch::Tensor>> back_;  // (device, host)
};

}  // namespace cohort::detail
