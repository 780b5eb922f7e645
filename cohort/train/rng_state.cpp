#include "cohort/train/rng_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <torch/cuda.h>

#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

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

void check_device_rng_state(const torch::Device& device, const torch::Tensor& state) {
  auto gen = at::globalContext().defaultGenerator(device);
  at::Generator copy;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    copy = gen.clone();
  }
  copy.set_state(state.clone(at::MemoryFormat::Contiguous));
}

void seed_device_rng(const torch::Device& device, uint64_t seed) {
  auto gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

DefaultRngStatesKept::DefaultRngStatesKept() : cpu_(cpu_rng_state()) {
  if (!torch::cuda::is_available()) return;
  const auto devices = static_cast<int>(torch::cuda::device_count());
  for (int i = 0; i < devices; ++i) {
    cuda_.push_back(
        device_rng_state(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(i))));
  }
}

DefaultRngStatesKept::~DefaultRngStatesKept() {
  // Setting a state the generator gave moments ago does not fail; were it
  // to, a destructor must not throw: the stream would go on shifted, said.
  try {
    set_cpu_rng_state(cpu_);
    for (size_t i = 0; i < cuda_.size(); ++i) {
      set_device_rng_state(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(i)), cuda_[i]);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cohort: the default generators' states were not restored: %s\n",
                 e.what());
  }
}

namespace {

void append_u64(std::vector<uint8_t>& out, uint64_t v) {
  uint8_t bytes[sizeof v];
  std::memcpy(bytes, &v, sizeof v);
  out.insert(out.end(), bytes, bytes + sizeof v);
}

// Reads a u64 at `at` of `data` (n bytes), moving `at` on; false past the end.
bool read_u64(const uint8_t* data, size_t n, size_t& at, uint64_t& v) {
  if (n - at < sizeof v) return false;
  std::memcpy(&v, data + at, sizeof v);
  at += sizeof v;
  return true;
}

}  // namespace

std::vector<RngStreams*> rng_streams_of(const torch::nn::Module& model) {
  std::vector<RngStreams*> out;
  std::set<RngStreams*> seen;
  // A module held twice (a GPT stage's chunks, each a pipeline stage) counts once.
  for (const auto& m : model.modules()) {
    auto* s = dynamic_cast<RngStreams*>(m.get());
    if (s && seen.insert(s).second) out.push_back(s);
  }
  return out;
}

torch::Tensor rng_streams_state(const std::vector<RngStreams*>& streams) {
  if (streams.empty()) return torch::empty({0}, torch::kUInt8);
  std::vector<uint8_t> out;
  append_u64(out, streams.size());
  for (const auto* s : streams) {
    const auto state = s->rng_state().to(torch::kUInt8).contiguous();
    append_u64(out, static_cast<uint64_t>(state.numel()));
    out.insert(out.end(), state.data_ptr<uint8_t>(), state.data_ptr<uint8_t>() + state.numel());
  }
  return torch::from_blob(out.data(), {static_cast<int64_t>(out.size())}, torch::kUInt8).clone();
}

void restore_rng_streams(const std::vector<RngStreams*>& streams, const torch::Tensor& state,
                         int64_t step) {
  std::vector<torch::Tensor> parts(streams.size());
  if (state.defined() && state.numel() > 0 && !streams.empty()) {
    const auto bytes = state.to(torch::kUInt8).contiguous();
    const auto* data = bytes.data_ptr<uint8_t>();
    const auto n = static_cast<size_t>(bytes.numel());
    size_t at = 0;
    uint64_t count = 0;
    bool ok = read_u64(data, n, at, count) && count == streams.size();
    for (size_t i = 0; ok && i < parts.size(); ++i) {
      uint64_t len = 0;
      ok = read_u64(data, n, at, len) && len <= n - at;
      if (!ok) break;
      parts[i] = bytes.narrow(0, static_cast<int64_t>(at), static_cast<int64_t>(len)).clone();
      at += len;
    }
    // Another model's streams: none continues, every one restarts.
    if (!ok) parts.assign(streams.size(), torch::Tensor());
  }
  for (size_t i = 0; i < streams.size(); ++i) streams[i]->restore_rng_state(parts[i], step);
}

}  // namespace cohort
