// defines: OptimizerStateKey, optimizer_state_key, CpuAllocatorBase,
// NodePtr, make_node, COHORT_C10D_STORE_HAS_CLONE, kZeroGradSetsToNone,
// autocast_enabled, set_autocast_enabled, autocast_dtype,
// set_autocast_dtype: every difference between
// the LibTorch releases cohort builds against (Debian 12's 1.13 and 2.x,
// e.g. Debian 13's 2.6, a pip wheel's 2.11, Debian testing's 2.14), in one
// place. Nothing else in the library, tests, tools or benchmarks names a
// LibTorch version (the top CMakeLists.txt takes the C++ standard from
// LibTorch's own headers: 20 where they require it, as 2.14's do).
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/csrc/autograd/function.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>
#include <torch/version.h>

#include <memory>
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

// What Optimizer::zero_grad() does by default: 1.13 zeroes each defined
// .grad in place (a parameter that had a gradient once keeps taking steps,
// with zeros, as long as no one sets its .grad to none), 2.x sets every
// .grad to none (zero_grad(bool set_to_none = true)). cohort's optimizers
// take the same default, so that they step what LibTorch's would.
#if TORCH_VERSION_MAJOR >= 2
inline constexpr bool kZeroGradSetsToNone = true;
#else
inline constexpr bool kZeroGradSetsToNone = false;
#endif

// The key type of `Optimizer::state()`: a string made from the parameter's
// TensorImpl pointer in 1.13, the pointer itself in 2.x. Taken from the
// running LibTorch's own map type, so it cannot drift from it.
using OptimizerStateKey =
    typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

namespace detail {
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
}  // namespace detail

// The key under which the running LibTorch's optimizers keep the state of
// `param`: `optimizer.state().find(optimizer_state_key(param))`.
inline OptimizerStateKey optimizer_state_key(const torch::Tensor& param) {
  return detail::state_key<OptimizerStateKey>(param.unsafeGetTensorImpl());
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

// The owning pointer of an autograd node: std::shared_ptr<Node> in 1.13 to
// 2.6, c10::intrusive_ptr<Node> in 2.14. Taken from Tensor::grad_fn()'s own
// return type, so it cannot drift from it.
using NodePtr = std::decay_t<decltype(std::declval<const torch::Tensor&>().grad_fn())>;

namespace detail {
template <class Ptr>
struct NodeMaker;
template <class N>
struct NodeMaker<std::shared_ptr<N>> {
  template <class T, class... Args>
  static std::shared_ptr<T> make(Args&&... args) {
    // LibTorch's own deleter (torch::autograd::deleteNode, found through
    // the node's namespace): it frees a long chain of nodes without a
    // recursion as deep as the chain. Named through the template
    // argument, since releases without it never instantiate this.
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...),
                              [](N* node) { deleteNode(node); });
  }
};
template <class N>
struct NodeMaker<c10::intrusive_ptr<N>> {
  template <class T, class... Args>
  static c10::intrusive_ptr<T> make(Args&&... args) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
};
}  // namespace detail

// A new autograd node of type T (a subclass of torch::autograd::Node),
// owned the way the running LibTorch owns nodes.
template <class T, class... Args>
auto make_node(Args&&... args) {
  return detail::NodeMaker<NodePtr>::template make<T>(std::forward<Args>(args)...);
}

// Autocast's state on this thread for one device type, kCPU or kCUDA:
// whether it is on, and the lower-precision dtype it casts to. 2.4 replaced
// the functions of each device type by ones taking it.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
inline bool autocast_enabled(c10::DeviceType device) {
  return at::autocast::is_autocast_enabled(device);
}
inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
  at::autocast::set_autocast_enabled(device, enabled);
}
inline at::ScalarType autocast_dtype(c10::DeviceType device) {
  return at::autocast::get_autocast_dtype(device);
}
inline void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
  at::autocast::set_autocast_dtype(device, dtype);
}
#else
inline bool autocast_enabled(c10::DeviceType device) {
  return device == c10::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
  if (device == c10::kCPU)
    at::autocast::set_cpu_enabled(enabled);
  else
    at::autocast::set_enabled(enabled);
}
inline at::ScalarType autocast_dtype(c10::DeviceType device) {
  return device == c10::kCPU ? at::autocast::get_autocast_cpu_dtype()
                             : at::autocast::get_autocast_gpu_dtype();
}
inline void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
  if (device == c10::kCPU)
    at::autocast::set_autocast_cpu_dtype(dtype);
  else
    at::autocast::set_autocast_gpu_dtype(dtype);
}
#endif

}  // namespace cohort
