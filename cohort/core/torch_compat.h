// defines: OptimizerStateKey, optimizer_state_key, CpuAllocatorBase,
// COHORT_C10D_STORE_HAS_CLONE: every difference between the LibTorch
// releases cohort builds against (Debian 12's 1.13 and 2.x, e.g. Debian 13's
// 2.6, a pip wheel's 2.11), in one place. Nothing else in the
// library, tests, tools or benchmarks names a LibTorch version.
#pragma once

#include <c10/core/Allocator.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/version.h>

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

// c10d::Store::clone() (a copy for another thread, over the same store)
// became pure virtual in LibTorch 2.8: a c10d store of cohort's defines it
// there, and only there, where it would override nothing.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#define COHORT_C10D_STORE_HAS_CLONE 1
#else
#define COHORT_C10D_STORE_HAS_CLONE 0
#endif

namespace cohort {

// The key type of `Optimizer::state()`: a string made from the parameter's
// TensorImpl pointer in 1.13, the pointer itself in 2.x. Taken from the
// running LibTorch's own map type, so it cannot drift from it.
using OptimizerStateKey =
    typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

namespace compat_detail {
template <class Key>
Key state_key(c10::TensorImpl* impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    // What 1.13's optimizers write, c10::guts::to_string(impl): the
    // pointer through operator<<. Any other spelling of the same address
    // misses the entry silently, and the state would be dropped.
    std::ostringstream out;
    out << static_cast<const void*>(impl);
    return out.str();
  } else {
    static_assert(std::is_same_v<Key, void*>,
                  "a LibTorch optimizer state key cohort does not know");
    return impl;
  }
}
}  // namespace compat_detail

// The key under which the running LibTorch's optimizers keep the state of
// `param`: `optimizer.state().find(optimizer_state_key(param))`.
inline OptimizerStateKey optimizer_state_key(const torch::Tensor& param) {
  return compat_detail::state_key<OptimizerStateKey>(param.unsafeGetTensorImpl());
}

// A CPU allocator's base. LibTorch 2.3 made `Allocator::allocate` non-const
// and added the pure virtual `copy_data`; a subclass implements
// `allocate_bytes` and works with either.
class CpuAllocatorBase : public c10::Allocator {
 public:
  virtual c10::DataPtr allocate_bytes(size_t n) const = 0;

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  c10::DataPtr allocate(size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t n) const override { return allocate_bytes(n); }
#endif
};

}  // namespace cohort
