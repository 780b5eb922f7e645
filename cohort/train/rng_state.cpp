#include "cohort/train/rng_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <mutex>

namespace cohort {

torch::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  // The generator is process-wide; other threads may draw from it.
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  // A tensor of its own: LibTorch 2.14's set_state crashes on one that
  // starts inside its storage (a row of the checkpoint's [world, bytes]).
  const auto own = state.clone(at::MemoryFormat::Contiguous);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(own);
}

torch::Tensor seeded_cpu_rng_state(uint64_t seed) {
  return at::detail::createCPUGenerator(seed).get_state();
}

torch::Tensor device_rng_state(const torch::Device& device) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_device_rng_state(const torch::Device& device, const torch::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(device);
  const auto own = state.clone(at::MemoryFormat::Contiguous);  // as set_cpu_rng_state
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(own);
}

void seed_device_rng(const torch::Device& device, uint64_t seed) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

}  // namespace cohort
