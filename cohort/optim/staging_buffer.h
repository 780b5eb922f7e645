// defines: StagingBuffer, a flat buffer used for part of every step whose
// pages go back to the kernel, lazily, between uses.
//
// Why: ZeRO stage 2 stages a full copy of the gradients during backward and
// the step only. Allocated afresh every step, such a buffer costs one page
// fault per 4 KiB when it is first written, because glibc's default
// settings serve blocks above 32 MiB with a fresh mmap (the 10M
// transformer's 36 MiB: 9.4k faults per step on the benchmark VM; see
// docs/benchmarks.md). Kept allocated, it would keep the full
// gradient size resident between steps, which stage 2 exists to avoid.
// So release() marks the pages MADV_FREE: the kernel may take them back
// whenever it needs memory (without writing them anywhere: their contents
// are garbage by then), and until it does, the next acquire() reuses them
// without faults. Linux counts such pages as available memory (LazyFree in
// /proc/meminfo) but still in the process's RSS until it reclaims them.
// Where MADV_FREE does not exist, release() frees the memory.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>

namespace cohort {

class StagingBuffer {
 public:
  StagingBuffer(int64_t numel, torch::TensorOptions options);

  /// The buffer for one use; its contents are undefined.
  torch::Tensor acquire();
  /// Ends the use: drops the tensor acquire() returned and hands the pages
  /// back (lazily). Tensors that still share the memory keep it mapped
  /// (nothing is unmapped under them) but their contents become undefined;
  /// the next acquire() returns the same memory.
  void release();
  bool in_use() const { return current_.defined(); }
  int64_t nbytes() const { return numel_ * static_cast<int64_t>(options_.dtype().itemsize()); }

 private:
  struct Mapping;
  int64_t numel_;
  torch::TensorOptions options_;
  std::shared_ptr<Mapping> mapping_;  ///< kept mapped between uses
  torch::Tensor current_;
};

}  // namespace cohort
