#include "cohort/memory/memory_scope.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>

#include "cohort/core/error.h"
#include "cohort/core/torch_compat.h"

namespace cohort::memory {

// One scope's counts. Referenced by its MemoryScope, by every live
// allocation made inside it and by the scopes nested in it, so that storage
// freed after the scope ended still finds its counter.
struct ScopeCounter {
  std::atomic<int64_t> refs{1};
  std::atomic<int64_t> current{0}, peak{0}, total{0};
  ScopeCounter* outer = nullptr;  // a counted reference
};

namespace {

thread_local ScopeCounter* t_scope = nullptr;

void add_ref(ScopeCounter* c) {
  if (c) c->refs.fetch_add(1, std::memory_order_relaxed);
}

void release(ScopeCounter* c) {
  while (c && c->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    ScopeCounter* outer = c->outer;
    delete c;
    c = outer;
  }
}

void charge(ScopeCounter* c, int64_t bytes) {
  for (; c; c = c->outer) {
    const int64_t now = c->current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    if (bytes <= 0) continue;
    c->total.fetch_add(bytes, std::memory_order_relaxed);
    int64_t peak = c->peak.load(std::memory_order_relaxed);
    while (now > peak && !c->peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
}

// Stored in front of each allocation. 64 bytes keep LibTorch's 64-byte
// alignment of the data that follows.
struct Header {
  ScopeCounter* scope;
  int64_t bytes;
};
constexpr size_t kHeaderBytes = 64;
static_assert(sizeof(Header) <= kHeaderBytes, "the header fits its slot");

c10::Allocator* g_base = nullptr;  // the allocator the counting one wraps

void counting_delete(void* data) {
  if (!data) return;
  auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeaderBytes);
  charge(header->scope, -header->bytes);
  release(header->scope);
  g_base->raw_deallocate(header);
}

// The data pointer is its own context, so the raw interface works too (some
// LibTorch paths, e.g. oneDNN's, allocate through raw_allocate).
class CountingAllocator final : public CpuAllocatorBase {
 public:
  c10::DataPtr allocate_bytes(size_t n) const override {
    if (n == 0) return {nullptr, nullptr, &counting_delete, c10::Device(c10::DeviceType::CPU)};
    void* base = g_base->raw_allocate(n + kHeaderBytes);
    auto* header = static_cast<Header*>(base);
    header->scope = t_scope;
    header->bytes = static_cast<int64_t>(n);
    add_ref(t_scope);
    charge(t_scope, header->bytes);
    void* data = static_cast<char*>(base) + kHeaderBytes;
    return {data, data, &counting_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
};

// Once per process. Racing a first allocation on another thread is benign in
// practice (one pointer store); create the first scope before other threads
// allocate to avoid even that.
void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::Allocator* base = c10::GetCPUAllocator();
    if (!base->raw_deleter())
      throw InvalidArgument(
          "MemoryScope: the CPU allocator in use has no raw interface, so it cannot be counted");
    g_base = base;
    static CountingAllocator counting;
    c10::SetCPUAllocator(&counting, /*priority=*/255);
  });
}

}  // namespace

MemoryScope::MemoryScope() : counter_(nullptr), outer_(t_scope) {
  install();
  counter_ = new ScopeCounter;
  counter_->outer = outer_;
  add_ref(outer_);
  t_scope = counter_;
}

MemoryScope::~MemoryScope() {
  t_scope = outer_;
  release(counter_);
}

int64_t MemoryScope::current_bytes() const { return counter_->current.load(); }
int64_t MemoryScope::peak_bytes() const { return counter_->peak.load(); }
int64_t MemoryScope::allocated_bytes() const { return counter_->total.load(); }
void MemoryScope::reset_peak() { counter_->peak.store(counter_->current.load()); }

}  // namespace cohort::memory
