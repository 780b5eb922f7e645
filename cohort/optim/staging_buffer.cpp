#include "cohort/optim/staging_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "cohort/core/error.h"

namespace cohort {

// An anonymous private mapping, unmapped when the last tensor over it and
// the buffer itself are gone.
struct StagingBuffer::Mapping {
  void* data = nullptr;
  size_t bytes = 0;
  explicit Mapping(size_t n) : bytes(n) {
    data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      throw Error("StagingBuffer: mmap of " + std::to_string(bytes) +
                  " bytes failed: " + std::strerror(errno));
    }
  }
  ~Mapping() { ::munmap(data, bytes); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
};

StagingBuffer::StagingBuffer(int64_t numel, torch::TensorOptions options)
    : numel_(numel), options_(options) {}

torch::Tensor StagingBuffer::acquire() {
  if (current_.defined()) return current_;
#ifdef MADV_FREE
  // Host memory only: a GPU's buffer comes from its caching allocator,
  // which keeps freed blocks without page faults already.
  if (options_.device().is_cpu()) {
    if (!mapping_) {
      const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
      const auto bytes = static_cast<size_t>(std::max<int64_t>(nbytes(), 1));
      mapping_ = std::make_shared<Mapping>((bytes + page - 1) / page * page);
    }
    // The deleter holds the mapping: a tensor that outlives the buffer (or
    // a use) still points at mapped memory.
    current_ = torch::from_blob(
        mapping_->data, {numel_}, [keep = mapping_](void*) {}, options_);
    return current_;
  }
#endif
  current_ = torch::empty({numel_}, options_);
  return current_;
}

void StagingBuffer::release() {
  if (!current_.defined()) return;
  current_ = torch::Tensor();
#ifdef MADV_FREE
  // Whether other tensors still share the memory is not checked: finished
  // collectives may drop their views of it a moment later (on their
  // engine's thread), and mapping anew whenever that happened cost the
  // very page faults this buffer exists to avoid. A tensor kept past a use
  // stays valid memory (its deleter holds the mapping) with undefined
  // contents, like a view of a reused bucket. The advice is only a hint:
  // if it fails the pages simply stay resident.
  if (mapping_) ::madvise(mapping_->data, mapping_->bytes, MADV_FREE);
#endif
}

}  // namespace cohort
