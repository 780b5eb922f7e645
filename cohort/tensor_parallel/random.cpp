#include "cohort/tensor_parallel/random.h"

#include <ATen/Context.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <ostream>
#include <sstream>

#include "cohort/core/error.h"

namespace cohort::tensor_parallel {
namespace {

// Leads every state(), so that set_state knows its own format: version 2
// carries each stream's current seed, version 1 (written before) did not.
constexpr uint64_t kStateMagic = 0x32676e7274726f63ULL;    // "cortrng2"
constexpr uint64_t kStateMagicV1 = 0x31676e7274726f63ULL;  // "cortrng1"

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// A new generator of `device` seeded with `seed`: a clone of the device's
// default generator (the only door to a CUDA one that a build without CUDA
// compiles), then seeded, since the clone has a state of its own. The CPU's
// is made the same way, so that what runs here is what a CUDA device runs.
at::Generator new_generator(const torch::Device& device, uint64_t seed) {
  auto fallback = at::globalContext().defaultGenerator(device);
  at::Generator gen;
  {
    std::lock_guard<std::mutex> lock(fallback.mutex());
    gen = fallback.clone();
  }
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
  return gen;
}

void check_device(const torch::Device& device, const char* where) {
  if (!device.is_cpu() && !device.has_index()) {
    throw InvalidArgument(std::string("tensor_parallel::RngTracker::") + where + ": device " +
                          device.str() + " has no index; name one (" + device.str() + ":0)");
  }
}

// The byte form of state(): little parts appended in order.
class Writer {
 public:
  void u64(uint64_t v) { raw(&v, sizeof v); }
  void bytes(const void* p, size_t n) {
    u64(n);
    raw(p, n);
  }
  void text(const std::string& s) { bytes(s.data(), s.size()); }
  torch::Tensor tensor() const {
    return torch::from_blob(const_cast<uint8_t*>(out_.data()), {static_cast<int64_t>(out_.size())},
                            torch::kUInt8)
        .clone();
  }

 private:
  void raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  explicit Reader(const torch::Tensor& t) : t_(t.to(torch::kUInt8).contiguous()) {}
  uint64_t u64() {
    uint64_t v = 0;
    need(sizeof v);
    std::memcpy(&v, data() + at_, sizeof v);
    at_ += sizeof v;
    return v;
  }
  torch::Tensor bytes() {
    const auto n = u64();
    need(n);
    auto out = t_.narrow(0, static_cast<int64_t>(at_), static_cast<int64_t>(n)).clone();
    at_ += n;
    return out;
  }
  std::string text() {
    const auto b = bytes();
    const auto* p = reinterpret_cast<const char*>(b.data_ptr<uint8_t>());
    return std::string(p, p + b.numel());
  }
  bool done() const { return at_ == static_cast<size_t>(t_.numel()); }

 private:
  const uint8_t* data() const { return t_.data_ptr<uint8_t>(); }
  void need(uint64_t n) const {
    if (static_cast<uint64_t>(t_.numel()) - at_ < n) {
      throw InvalidArgument("tensor_parallel::RngTracker::set_state: the state ends early (" +
                            std::to_string(t_.numel()) + " bytes)");
    }
  }
  torch::Tensor t_;
  size_t at_ = 0;
};

// A state(), read: its place in the TP group and each stream's generators.
struct SavedState {
  uint64_t tp_rank = 0, tp_size = 0, group = 0;
  struct Stream {
    std::string name;
    std::optional<uint64_t> current;  // none in version 1
    std::vector<std::pair<torch::Device, torch::Tensor>> generators;
  };
  std::vector<Stream> streams;
};

bool holds(const SavedState::Stream& saved, const torch::Device& device) {
  return std::any_of(saved.generators.begin(), saved.generators.end(),
                     [&](const auto& entry) { return entry.first == device; });
}

SavedState parse(const torch::Tensor& state) {
  if (!state.defined() || state.dim() != 1) {
    throw InvalidArgument(
        "tensor_parallel::RngTracker::set_state: not a state (a 1-D uint8 tensor)");
  }
  Reader in(state);
  const auto magic = in.u64();
  if (magic != kStateMagic && magic != kStateMagicV1) {
    throw InvalidArgument("tensor_parallel::RngTracker::set_state: not an RngTracker's state");
  }
  SavedState s;
  s.tp_rank = in.u64();
  s.tp_size = in.u64();
  s.group = in.u64();
  const auto n = in.u64();
  for (uint64_t i = 0; i < n; ++i) {
    auto& stream = s.streams.emplace_back();
    stream.name = in.text();
    if (magic == kStateMagic) stream.current = in.u64();
    const auto devices = in.u64();
    for (uint64_t d = 0; d < devices; ++d) {
      const auto name = in.text();
      std::optional<torch::Device> device;
      try {
        device.emplace(name);
      } catch (const c10::Error&) {
        throw InvalidArgument("tensor_parallel::RngTracker::set_state: no device '" + name + "'");
      }
      stream.generators.emplace_back(*device, in.bytes());
    }
  }
  if (!in.done()) {
    throw InvalidArgument("tensor_parallel::RngTracker::set_state: bytes after the state");
  }
  return s;
}

}  // namespace

RngTrackerImpl::RngTrackerImpl(const DeviceMesh& mesh, uint64_t seed)
    : torch::nn::Module("RngTracker") {
  const auto tp = mesh["tp"];
  tp_ = tp.process_group();
  tp_rank_ = tp_->rank();
  tp_size_ = tp_->size();
  // g: this rank's coordinates along every other dimension, row-major.
  const auto names = mesh.dim_names();
  const auto shape = mesh.shape();
  const auto coordinate = mesh.coordinate();
  for (size_t d = 0; d < names.size(); ++d) {
    if (names[d] == "tp") continue;
    group_ = group_ * static_cast<uint64_t>(shape[d]) + static_cast<uint64_t>(coordinate[d]);
  }
  const uint64_t base = seed + kGroupStride * group_;
  add(kReplicated, base);
  add(kModelParallel, base + kModelParallelOffset + static_cast<uint64_t>(tp_rank_));
}

void RngTrackerImpl::add(const std::string& name, uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [n, s] : streams_) {
    if (n == name || s.seed == seed) {
      throw InvalidArgument(
          "tensor_parallel::RngTracker::add (tp rank " + std::to_string(tp_rank_) + "): " +
          (n == name ? "stream '" + name + "' exists"
                     : "seed " + std::to_string(seed) + " is stream '" + n + "''s"));
    }
  }
  Stream stream;
  stream.seed = stream.current = seed;
  streams_.emplace_back(name, std::move(stream));
  std::sort(streams_.begin(), streams_.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
}

std::vector<std::string> RngTrackerImpl::names() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& entry : streams_) out.push_back(entry.first);
  return out;
}

RngTrackerImpl::Stream& RngTrackerImpl::stream_locked(const std::string& name) {
  for (auto& [n, s] : streams_) {
    if (n == name) return s;
  }
  std::string known;
  for (const auto& entry : streams_) known += (known.empty() ? "" : ", ") + entry.first;
  throw InvalidArgument("tensor_parallel::RngTracker (tp rank " + std::to_string(tp_rank_) +
                        "): no stream '" + name + "' (it has " + known + ")");
}

uint64_t RngTrackerImpl::seed(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return const_cast<RngTrackerImpl*>(this)->stream_locked(name).seed;
}

at::Generator RngTrackerImpl::generator_locked(Stream& stream, const torch::Device& device) {
  for (const auto& [d, gen] : stream.generators) {
    if (d == device) return gen;
  }
  stream.generators.emplace_back(device, new_generator(device, stream.current));
  return stream.generators.back().second;
}

at::Generator RngTrackerImpl::generator(const std::string& name, const torch::Device& device) {
  check_device(device, "generator");
  std::lock_guard<std::mutex> lock(mu_);
  return generator_locked(stream_locked(name), device);
}

std::vector<at::Generator> RngTrackerImpl::generators(const torch::Device& device) {
  check_device(device, "generators");
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<at::Generator> out;
  for (auto& entry : streams_) out.push_back(generator_locked(entry.second, device));
  return out;
}

torch::Tensor RngTrackerImpl::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  Writer out;
  out.u64(kStateMagic);
  out.u64(static_cast<uint64_t>(tp_rank_));
  out.u64(static_cast<uint64_t>(tp_size_));
  out.u64(group_);
  out.u64(streams_.size());
  for (const auto& [name, stream] : streams_) {
    out.text(name);
    out.u64(stream.current);
    out.u64(stream.generators.size());
    for (auto [device, gen] : stream.generators) {
      out.text(device.str());
      torch::Tensor bytes;
      {
        std::lock_guard<std::mutex> gen_lock(gen.mutex());
        bytes = gen.get_state().contiguous();
      }
      out.bytes(bytes.data_ptr<uint8_t>(), static_cast<size_t>(bytes.numel()));
    }
  }
  return out.tensor();
}

RngTrackerImpl::Prepared RngTrackerImpl::prepare(const torch::Tensor& state) {
  const auto saved = parse(state);
  const std::string where = "tensor_parallel::RngTracker::set_state (tp rank " +
                            std::to_string(tp_rank_) + " of " + std::to_string(tp_size_) + "): ";
  if (saved.tp_rank != static_cast<uint64_t>(tp_rank_) ||
      saved.tp_size != static_cast<uint64_t>(tp_size_)) {
    throw InvalidArgument(where + "the state is tp rank " + std::to_string(saved.tp_rank) + " of " +
                          std::to_string(saved.tp_size) + "'s");
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::string mine, theirs;
  for (const auto& entry : streams_) mine += " '" + entry.first + "'";
  for (const auto& entry : saved.streams) theirs += " '" + entry.name + "'";
  if (mine != theirs) {
    throw InvalidArgument(where + "the state has the streams" + theirs + ", this tracker" + mine);
  }
  // Each state is tried on a copy of its generator first: a state that one
  // does not take leaves every generator as it was.
  Prepared out;
  out.group = saved.group;
  for (size_t i = 0; i < saved.streams.size(); ++i) {
    const auto& name = saved.streams[i].name;
    const auto& held = saved.streams[i].generators;
    const uint64_t current = saved.streams[i].current.value_or(streams_[i].second.current);
    out.currents.emplace_back(name, current);
    // A generator the state does not hold (made since it was taken) starts
    // over at the stream's current seed, as one made after the restore.
    for (const auto& [device, gen] : streams_[i].second.generators) {
      if (!holds(saved.streams[i], device)) out.restarts.emplace_back(gen, current);
    }
    for (const auto& [device, bytes] : held) {
      try {
        check_device(device, "set_state");
        auto gen = generator_locked(streams_[i].second, device);
        gen.clone().set_state(bytes);
        out.updates.emplace_back(gen, bytes);
      } catch (const c10::Error& e) {
        throw InvalidArgument(where + "stream '" + name + "' on " + device.str() + ": " +
                              e.what_without_backtrace());
      }
    }
  }
  return out;
}

void RngTrackerImpl::commit(Prepared& prepared) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, current] : prepared.currents) stream_locked(name).current = current;
  for (auto& [gen, bytes] : prepared.updates) {
    std::lock_guard<std::mutex> gen_lock(gen.mutex());
    gen.set_state(bytes);
  }
  for (auto& [gen, seed] : prepared.restarts) {
    std::lock_guard<std::mutex> gen_lock(gen.mutex());
    gen.set_current_seed(seed);
  }
}

void RngTrackerImpl::set_state(const torch::Tensor& state) {
  auto prepared = prepare(state);
  commit(prepared);
}

void RngTrackerImpl::reseed(uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& entry : streams_) {
    const uint64_t seed = splitmix64(entry.second.seed ^ splitmix64(step));
    entry.second.current = seed;  // for the generators it makes from now on too
    for (auto& [device, gen] : entry.second.generators) {
      std::lock_guard<std::mutex> gen_lock(gen.mutex());
      gen.set_current_seed(seed);
    }
  }
}

void RngTrackerImpl::restore_rng_state(const torch::Tensor& state, int64_t step) {
  // Whether this rank's saved state fits this tracker at its TP rank...
  std::optional<Prepared> prepared;
  if (state.defined() && state.numel() > 0) {
    try {
      prepared = prepare(state);
    } catch (const InvalidArgument&) {
    }
  }
  // ...and, over the group, whether its ranks restore one old TP group.
  auto mine = torch::tensor(
      {int64_t{prepared.has_value()}, prepared ? static_cast<int64_t>(prepared->group) : 0},
      torch::kInt64);
  auto all = torch::empty({tp_size_ * 2}, torch::kInt64);
  tp_->all_gather_into_tensor(all, mine).wait();
  const auto* v = all.data_ptr<int64_t>();
  bool agree = true;
  for (int r = 0; r < tp_size_; ++r) agree = agree && v[2 * r] == 1 && v[2 * r + 1] == v[1];
  if (agree) {
    commit(*prepared);
  } else {
    reseed(static_cast<uint64_t>(step));
  }
}

void RngTrackerImpl::to(torch::Device device, torch::Dtype, bool non_blocking) {
  to(device, non_blocking);
}

void RngTrackerImpl::to(torch::Device device, bool) {
  if (!device.is_cpu() && !device.has_index()) return;  // the tensors' device decides, at first use
  generators(device);
}

void RngTrackerImpl::pretty_print(std::ostream& stream) const {
  stream << "cohort::tensor_parallel::RngTracker(tp_rank=" << tp_rank_ << ", tp_size=" << tp_size_
         << ", group=" << group_ << ")";
}

torch::Tensor dropout(const torch::Tensor& input, double p, bool train, at::Generator generator) {
  if (!(p >= 0 && p <= 1)) {
    std::ostringstream os;
    os << "tensor_parallel::dropout: p " << p << " is not in [0, 1]";
    throw InvalidArgument(os.str());
  }
  if (!train || p == 0) return input;
  if (!generator.defined()) throw InvalidArgument("tensor_parallel::dropout: no generator");
  if (generator.device() != input.device()) {
    throw InvalidArgument("tensor_parallel::dropout: a generator of " + generator.device().str() +
                          " for a tensor on " + input.device().str());
  }
  if (p == 1) return input * torch::zeros_like(input);
  auto keep = torch::empty(input.sizes(), input.options()).bernoulli_(1 - p, generator);
  return input * keep.div_(1 - p);
}

}  // namespace cohort::tensor_parallel
