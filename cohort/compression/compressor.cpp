#include "cohort/compression/compressor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/compression/compressed_collectives.h"
#include "cohort/compression/powersgd.h"
#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort::compression {
namespace {

void check_input(const at::Tensor& t) {
  if (!t.defined() || t.scalar_type() != at::kFloat || !t.is_contiguous() || !t.device().is_cpu()) {
    throw InvalidArgument("cohort: compressed_all_reduce takes a contiguous float32 CPU tensor");
  }
}

// State maps are keyed "<what>_<tensor key>" (no dots: checkpoint archives refuse them).
std::string state_name(const std::string& what, int64_t key) {
  return what + "_" + std::to_string(key);
}

void save_map(std::map<std::string, at::Tensor>& out, const std::string& what,
              const std::map<int64_t, at::Tensor>& in) {
  for (auto& [key, t] : in) {
    if (t.defined()) out[state_name(what, key)] = t.clone();
  }
}

void load_map(const std::map<std::string, at::Tensor>& in, const std::string& what,
              std::map<int64_t, at::Tensor>& out) {
  out.clear();
  const std::string prefix = what + "_";
  for (auto& [name, t] : in) {
    if (name.rfind(prefix, 0) == 0) {
      out[std::stoll(name.substr(prefix.size()))] = t.clone();
    }
  }
}

// `range` of the state kept under `key` in `states`, or nothing while there
// is none of the tensor's size.
std::vector<at::Tensor> range_of(const std::map<int64_t, at::Tensor>& states, int64_t key,
                                 const ElementRange& range) {
  const auto it = states.find(key);
  if (it == states.end() || !it->second.defined() ||
      it->second.numel() < range.offset + range.count) {
    return {};
  }
  return {it->second.narrow(0, range.offset, range.count)};
}

class NoCompression : public Compressor {
 public:
  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t key,
                  const std::vector<at::Tensor>&) override {
    agree(comm, {}, key, flat.numel());
    comm.all_reduce(flat, {ReduceOp::Avg}).wait();
  }
  std::string name() const override { return "none"; }
};

class LowPrecision : public Compressor {
 public:
  explicit LowPrecision(at::ScalarType wire) : wire_(wire) {
    o_.kind = wire == at::kHalf ? CompressionKind::Fp16 : CompressionKind::Bf16;
  }
  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t key,
                  const std::vector<at::Tensor>&) override {
    agree(comm, o_, key, flat.numel());
    low_precision_all_reduce(comm, flat, wire_);
  }
  std::string name() const override { return wire_ == at::kHalf ? "fp16" : "bf16"; }

 private:
  at::ScalarType wire_;
  CompressionOptions o_;
};

class Int8 : public Compressor {
 public:
  explicit Int8(const CompressionOptions& o)
      : o_(o), chunk_(o.int8_chunk), feedback_(o.error_feedback) {}
  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t key,
                  const std::vector<at::Tensor>&) override {
    agree(comm, o_, key, flat.numel());
    if (!feedback_) return int8_all_reduce(comm, flat, chunk_, nullptr);
    Int8ErrorFeedback ef{worker_[key], owner_[key]};
    int8_all_reduce(comm, flat, chunk_, &ef);
    worker_[key] = ef.worker;
    owner_[key] = ef.owner;
  }
  std::string name() const override { return "int8"; }
  std::map<std::string, at::Tensor> state() const override {
    std::map<std::string, at::Tensor> s;
    save_map(s, "int8_worker_error", worker_);
    save_map(s, "int8_owner_error", owner_);
    return s;
  }
  void load_state(const std::map<std::string, at::Tensor>& s) override {
    load_map(s, "int8_worker_error", worker_);
    load_map(s, "int8_owner_error", owner_);
  }

 protected:
  void forget(int64_t key) override {
    worker_.erase(key);
    owner_.erase(key);
  }
  // The worker error of the range, then the owner error of the part of it
  // this rank owns.
  std::vector<at::Tensor> element_state(int64_t key, const ElementRange& range, int rank,
                                        int size) override {
    auto views = range_of(worker_, key, range);
    const auto owner = owner_.find(key);
    if (views.empty() || owner == owner_.end() || !owner->second.defined()) return {};
    const int64_t end = range.offset + range.count;
    int64_t at = 0;  // position in the owner error
    for (auto [offset, count] : int8_owned_elements(worker_.at(key).numel(), chunk_, rank, size)) {
      const int64_t lo = std::max(offset, range.offset), hi = std::min(offset + count, end);
      if (lo < hi) views.push_back(owner->second.narrow(0, at + lo - offset, hi - lo));
      at += count;
    }
    return views;
  }

 private:
  CompressionOptions o_;
  int64_t chunk_;
  bool feedback_;
  std::map<int64_t, at::Tensor> worker_, owner_;
};

// The k entries of x[0, n) of largest magnitude, in ascending index order,
// as (index, value) pairs; ties at the k-th magnitude go to the lowest
// indices. Three passes over x instead of at::topk's sort of n (value,
// index) pairs: a histogram of the magnitudes' top bits (sign dropped: 8
// exponent and 3 mantissa bits) finds the bin holding the k-th largest; the
// magnitudes in that bin give its exact value t; a last pass takes every
// entry above t and the first ties. Magnitudes compare as their bit
// patterns, which order non-negative floats as their values (NaN above inf).
// Returns whether x holds a non-finite value (a bin at or above inf's).
bool select_top_k(const float* x, int64_t n, int64_t k, int32_t* index, float* values) {
  constexpr int kShift = 20;
  auto magnitude = [x](int64_t i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    return bits & 0x7fffffffu;
  };
  std::vector<int64_t> histogram(1u << (31 - kShift), 0);
  for (int64_t i = 0; i < n; ++i) ++histogram[magnitude(i) >> kShift];
  int64_t above = 0;  // entries in bins above `bin`
  uint32_t bin = static_cast<uint32_t>(histogram.size() - 1);
  for (; bin > 0 && above + histogram[bin] < k; --bin) above += histogram[bin];
  std::vector<uint32_t> in_bin;
  in_bin.reserve(histogram[bin]);
  for (int64_t i = 0; i < n; ++i) {
    if ((magnitude(i) >> kShift) == bin) in_bin.push_back(magnitude(i));
  }
  const int64_t need = k - above;  // 1 <= need <= in_bin.size()
  std::nth_element(in_bin.begin(), in_bin.begin() + (need - 1), in_bin.end(), std::greater<>());
  const uint32_t t = in_bin[need - 1];
  int64_t ties =
      need - std::count_if(in_bin.begin(), in_bin.end(), [t](uint32_t m) { return m > t; });
  for (int64_t i = 0, j = 0; i < n && j < k; ++i) {
    const uint32_t m = magnitude(i);
    if (m > t || (m == t && ties > 0)) {
      if (m == t) --ties;
      index[j] = static_cast<int32_t>(i);
      values[j++] = x[i];
    }
  }
  const auto first_non_finite = histogram.begin() + (0x7f800000u >> kShift);
  return std::any_of(first_non_finite, histogram.end(), [](int64_t c) { return c > 0; });
}

// Sends the k largest magnitudes of (gradient + error) as (index, value)
// pairs by all-gather; every rank adds all pairs in rank order, so all end
// with the same sum. What was not sent stays in the error buffer, which
// also holds (gradient + error) while the pairs are chosen, so no pass
// allocates a tensor of the bucket's size.
class TopK : public Compressor {
 public:
  explicit TopK(const CompressionOptions& o)
      : o_(o), ratio_(o.topk_ratio), feedback_(o.error_feedback) {}
  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t key,
                  const std::vector<at::Tensor>&) override {
    const int64_t n = flat.numel();
    // Every rank refuses a tensor too large, before any message.
    if (n > std::numeric_limits<int32_t>::max()) {
      throw InvalidArgument("cohort: top-k compression sends int32 indices; tensor too large");
    }
    agree(comm, o_, key, n);
    if (n == 0) return;
    auto x = flat.view(-1);
    auto& error = error_[key];
    if (feedback_) {
      if (!error.defined() || error.numel() != n) error = at::zeros({n}, at::kFloat);
      x = error.add_(x);
    }
    const int64_t k =
        std::min<int64_t>(n, std::max<int64_t>(1, std::llround(std::ceil(ratio_ * n))));
    auto index = at::empty({k}, at::kInt), values = at::empty({k}, at::kFloat);
    const bool non_finite = select_top_k(x.data_ptr<float>(), n, k, index.data_ptr<int32_t>(),
                                         values.data_ptr<float>());
    if (feedback_) {
      float* e = error.data_ptr<float>();
      for (const int32_t* i = index.data_ptr<int32_t>(); i != index.data_ptr<int32_t>() + k; ++i) {
        e[*i] = 0.0f;
      }
      // A non-finite entry left behind would be sent, and return as NaN or
      // inf, at every later step: it is this step's to carry, not theirs.
      if (non_finite) {
        for (int64_t i = 0; i < n; ++i) e[i] = std::isfinite(e[i]) ? e[i] : 0.0f;
      }
    }
    const int p = comm.size();
    auto all_index = at::empty({p * k}, at::kInt), all_values = at::empty({p * k}, at::kFloat);
    auto w1 = comm.all_gather_into_tensor(all_index, index);
    auto w2 = comm.all_gather_into_tensor(all_values, values);
    w1.wait();
    w2.wait();
    const int32_t* ai = all_index.data_ptr<int32_t>();
    check_indices(comm, ai, k, n, key);
    flat.zero_();
    float* out = flat.data_ptr<float>();
    const float* av = all_values.data_ptr<float>();
    for (int64_t j = 0; j < p * k; ++j) out[ai[j]] += av[j];
    flat.div_(p);
  }
  std::string name() const override { return "topk"; }
  std::map<std::string, at::Tensor> state() const override {
    std::map<std::string, at::Tensor> s;
    save_map(s, "topk_error", error_);
    return s;
  }
  void load_state(const std::map<std::string, at::Tensor>& s) override {
    load_map(s, "topk_error", error_);
  }

 protected:
  void forget(int64_t key) override { error_.erase(key); }
  std::vector<at::Tensor> element_state(int64_t key, const ElementRange& range, int, int) override {
    return range_of(error_, key, range);
  }

 private:
  // Indices come from peers: each must fall inside this rank's tensor
  // before it is written through (the settings agreed, so only a peer's
  // bug or corruption gets here).
  static void check_indices(const Communicator& comm, const int32_t* index, int64_t k, int64_t n,
                            int64_t key) {
    for (int64_t j = 0; j < comm.size() * k; ++j) {
      if (index[j] < 0 || index[j] >= n) {
        throw Error("cohort: top-k compression on rank " + std::to_string(comm.rank()) + " of " +
                    std::to_string(comm.size()) + " (group " + comm.name() + ", peer " +
                    std::to_string(j / k) + ", tensor key " + std::to_string(key) +
                    "): received index " + std::to_string(index[j]) + " outside [0, " +
                    std::to_string(n) + ")");
      }
    }
  }

  CompressionOptions o_;
  double ratio_;
  bool feedback_;
  std::map<int64_t, at::Tensor> error_;
};

// The fingerprint agree() exchanges: the kind, every setting (0 where the
// kind does not read it, so unused fields never differ), the size and a
// hash of the layout words. Fixed length, so ranks of different kinds can
// still gather each other's.
enum class Shown { Kind, Bool, Int, Double };
struct Field {
  const char* name;
  Shown shown;
};
constexpr Field kFields[] = {
    {"compression kind", Shown::Kind},
    {"error_feedback", Shown::Bool},
    {"int8_chunk", Shown::Int},
    {"topk_ratio", Shown::Double},
    {"powersgd_rank", Shown::Int},
    {"powersgd_start_iteration", Shown::Int},
    {"powersgd_min_compression_rate", Shown::Double},
    {"powersgd_warm_start", Shown::Bool},
    {"powersgd_seed", Shown::Int},
    {"tensor size (elements)", Shown::Int},
    {"tensor layout (the shapes of its views, hashed)", Shown::Int},
};
constexpr int64_t kFieldCount = sizeof(kFields) / sizeof(kFields[0]);

int64_t bits_of(double v) {
  int64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

std::vector<int64_t> fingerprint(const CompressionOptions& o, int64_t numel,
                                 const std::vector<int64_t>& layout) {
  std::vector<int64_t> f(kFieldCount, 0);
  const auto kind = o.kind;
  f[0] = static_cast<int64_t>(kind);
  const bool stateful = kind == CompressionKind::Int8 || kind == CompressionKind::TopK ||
                        kind == CompressionKind::PowerSGD;
  if (stateful) f[1] = o.error_feedback;
  if (kind == CompressionKind::Int8) f[2] = o.int8_chunk;
  if (kind == CompressionKind::TopK) f[3] = bits_of(o.topk_ratio);
  if (kind == CompressionKind::PowerSGD) {
    f[4] = o.powersgd_rank;
    f[5] = o.powersgd_start_iteration;
    f[6] = bits_of(o.powersgd_min_compression_rate);
    f[7] = o.powersgd_warm_start;
    f[8] = o.powersgd_seed;
  }
  f[9] = numel;
  f[10] = layout.empty() ? 0 : static_cast<int64_t>(fnv1a_words(layout));
  return f;
}

std::string show(const Field& field, int64_t v) {
  switch (field.shown) {
    case Shown::Kind:
      return v >= 0 && v <= static_cast<int64_t>(CompressionKind::PowerSGD)
                 ? to_string(static_cast<CompressionKind>(v))
                 : "kind " + std::to_string(v);
    case Shown::Bool:
      return v ? "true" : "false";
    case Shown::Int:
      return std::to_string(v);
    case Shown::Double: {
      double d;
      std::memcpy(&d, &v, sizeof d);
      std::ostringstream os;
      os.precision(17);
      os << d;
      return os.str();
    }
  }
  return std::to_string(v);
}

// One all-gather of the fingerprint's hash (8 bytes a rank: small next to
// a compressed bucket); only when the hashes differ, a second of the whole
// fingerprints, to say what differs. Every rank sees the same gathered
// values and scans them in the same order, so every rank throws the same
// message (but its own rank in it).
void check_fingerprints(Communicator& comm, int64_t key, const std::vector<int64_t>& mine) {
  const int p = comm.size();
  if (gather_words(comm, {static_cast<int64_t>(fnv1a_words(mine))}).same()) return;
  const RankWords all = gather_words(comm, mine);
  for (int64_t f = 0; f < kFieldCount; ++f) {
    const auto values = all.values([&](const int64_t* w) { return show(kFields[f], w[f]); });
    if (all_same(values)) continue;
    int r = 1;
    while (all.of(r)[f] == all.of(0)[f]) ++r;
    const std::string what = std::string(kFields[f].name) + " is " + values[0] + " on rank 0 but " +
                             values[static_cast<size_t>(r)] + " on rank " + std::to_string(r) +
                             " (" + name_groups(values) + ")";
    throw MismatchError("cohort: compression on rank " + std::to_string(comm.rank()) + " of " +
                        std::to_string(p) + " (group " + comm.name() + ", tensor key " +
                        std::to_string(key) + "): the ranks disagree: " + what +
                        "; every rank must compress with the same settings and tensor sizes");
  }
  COHORT_CHECK(false, "compression fingerprints hash differently but are equal");
}

}  // namespace

void Compressor::agree(Communicator& comm, const CompressionOptions& options, int64_t key,
                       int64_t numel, const std::vector<int64_t>& layout) {
  auto mine = fingerprint(options, numel, layout);
  auto it = agreed_.find(key);
  if (it != agreed_.end() && it->second == mine) return;
  if (comm.size() > 1) check_fingerprints(comm, key, mine);
  agreed_[key] = std::move(mine);
}

void Compressor::reset(int64_t key) {
  agreed_.erase(key);
  held_.erase(key);
  forget(key);
}

void Compressor::hold(const Communicator& comm, int64_t key,
                      const std::vector<ElementRange>& ranges) {
  auto& held = held_[key];
  held.clear();
  for (const auto& range : ranges) {
    Held h{range, {}};
    for (const auto& view : element_state(key, range, comm.rank(), comm.size())) {
      h.copies.push_back(view.clone());
    }
    held.push_back(std::move(h));
  }
}

void Compressor::put_back(const Communicator& comm, int64_t key,
                          const std::vector<ElementRange>& ranges) {
  const auto it = held_.find(key);
  for (const auto& range : ranges) {
    const Held* held = nullptr;
    if (it != held_.end()) {
      for (const auto& h : it->second) {
        if (h.range.offset == range.offset && h.range.count == range.count) held = &h;
      }
    }
    COHORT_CHECK(held != nullptr, "compression: put_back of elements that were not held");
    auto views = element_state(key, range, comm.rank(), comm.size());
    // No state at hold(): the step created it, and before it the error was zero.
    const bool had = held->copies.size() == views.size();
    for (size_t v = 0; v < views.size(); ++v) {
      if (had && held->copies[v].sizes() == views[v].sizes()) {
        views[v].copy_(held->copies[v]);
      } else {
        views[v].zero_();
      }
    }
  }
}

std::string to_string(CompressionKind kind) {
  switch (kind) {
    case CompressionKind::None:
      return "none";
    case CompressionKind::Fp16:
      return "fp16";
    case CompressionKind::Bf16:
      return "bf16";
    case CompressionKind::Int8:
      return "int8";
    case CompressionKind::TopK:
      return "topk";
    case CompressionKind::PowerSGD:
      return "powersgd";
  }
  return "none";
}

CompressionKind parse_compression_kind(const std::string& name) {
  for (auto k : {CompressionKind::None, CompressionKind::Fp16, CompressionKind::Bf16,
                 CompressionKind::Int8, CompressionKind::TopK, CompressionKind::PowerSGD}) {
    if (to_string(k) == name) return k;
  }
  throw InvalidArgument("cohort: unknown compression '" + name +
                        "' (none, fp16, bf16, int8, topk, powersgd)");
}

std::unique_ptr<Compressor> make_compressor(const CompressionOptions& o) {
  switch (o.kind) {
    case CompressionKind::None:
      return std::make_unique<NoCompression>();
    case CompressionKind::Fp16:
      return std::make_unique<LowPrecision>(at::kHalf);
    case CompressionKind::Bf16:
      return std::make_unique<LowPrecision>(at::kBFloat16);
    case CompressionKind::Int8:
      if (o.int8_chunk < 1) throw InvalidArgument("cohort: int8 compression needs int8_chunk >= 1");
      return std::make_unique<Int8>(o);
    case CompressionKind::TopK:
      if (!(o.topk_ratio > 0 && o.topk_ratio <= 1)) {
        throw InvalidArgument("cohort: top-k compression needs 0 < topk_ratio <= 1");
      }
      return std::make_unique<TopK>(o);
    case CompressionKind::PowerSGD:
      return make_powersgd(o);
  }
  throw InvalidArgument("cohort: unknown compression kind");
}

void compressed_all_reduce(Communicator& comm, at::Tensor& tensor, Compressor& compressor,
                           int64_t key) {
  check_input(tensor);
  auto flat = tensor.view(-1);
  compressor.all_reduce(comm, flat, key, {tensor});
}

}  // namespace cohort::compression
