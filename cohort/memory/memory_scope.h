// defines: MemoryScope, which counts the bytes of CPU tensor storage that
// the code running inside it allocates: current, peak and total.
//
// Resident set size is too coarse to see one micro-batch's activations and
// mixes ranks that run as threads of one process. A scope counts exactly
// the storage LibTorch allocates on its thread while it is alive, wherever
// that storage is freed later (another thread, after the scope ended), so
// each rank thread of a test, or each rank process, measures its own.
//
// The first scope installs a counting CPU allocator in front of LibTorch's
// (c10::SetCPUAllocator) for the rest of the process: every allocation after
// that carries a 64-byte header naming its scope (null outside any scope),
// and storage freed through it is uncounted wherever it is freed. Storage
// allocated before that keeps the allocator it came from.
#pragma once

#include <cstdint>

namespace cohort::memory {

struct ScopeCounter;

/// Counts the CPU tensor storage allocated on this thread while alive.
/// Scopes nest: an allocation counts in the innermost scope and in every
/// scope around it. Create and destroy a scope on the same thread; it is
/// neither copied nor moved. Reading the counts is safe from any thread.
class MemoryScope {
 public:
  MemoryScope();
  ~MemoryScope();
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;

  /// Bytes allocated inside the scope and not freed yet.
  int64_t current_bytes() const;
  /// The most current_bytes() has been since construction or reset_peak().
  int64_t peak_bytes() const;
  /// Bytes allocated inside the scope in all, freed or not.
  int64_t allocated_bytes() const;
  /// Starts a new peak from current_bytes().
  void reset_peak();

 private:
  ScopeCounter* counter_;
  ScopeCounter* outer_;  // the thread's scope before this one
};

}  // namespace cohort::memory
