#include "cohort/compression/compressor.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/compression/compressed_collectives.h"
#include "cohort/compression/powersgd.h"
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

class NoCompression : public Compressor {
 public:
  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t,
                  const std::vector<at::Tensor>&) override {
    comm.all_reduce(flat, {ReduceOp::Avg}).wait();
  }
  std::string name() const override { return "none"; }
};

class LowPrecision : public Compressor {
 public:
  explicit LowPrecision(at::ScalarType wire) : wire_(wire) {}
  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t,
                  const std::vector<at::Tensor>&) override {
    low_precision_all_reduce(comm, flat, wire_);
  }
  std::string name() const override { return wire_ == at::kHalf ? "fp16" : "bf16"; }

 private:
  at::ScalarType wire_;
};

class Int8 : public Compressor {
 public:
  explicit Int8(const CompressionOptions& o) : chunk_(o.int8_chunk), feedback_(o.error_feedback) {}
  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t key,
                  const std::vector<at::Tensor>&) override {
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

 private:
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
void select_top_k(const float* x, int64_t n, int64_t k, int32_t* index, float* values) {
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
}

// Sends the k largest magnitudes of (gradient + error) as (index, value)
// pairs by all-gather; every rank adds all pairs in rank order, so all end
// with the same sum. What was not sent stays in the error buffer, which
// also holds (gradient + error) while the pairs are chosen, so no pass
// allocates a tensor of the bucket's size.
class TopK : public Compressor {
 public:
  explicit TopK(const CompressionOptions& o) : ratio_(o.topk_ratio), feedback_(o.error_feedback) {}
  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t key,
                  const std::vector<at::Tensor>&) override {
    const int64_t n = flat.numel();
    if (n == 0) return;
    if (n > std::numeric_limits<int32_t>::max()) {
      throw InvalidArgument("cohort: top-k compression sends int32 indices; tensor too large");
    }
    auto x = flat.view(-1);
    auto& error = error_[key];
    if (feedback_) {
      if (!error.defined() || error.numel() != n) error = at::zeros({n}, at::kFloat);
      x = error.add_(x);
    }
    const int64_t k =
        std::min<int64_t>(n, std::max<int64_t>(1, std::llround(std::ceil(ratio_ * n))));
    auto index = at::empty({k}, at::kInt), values = at::empty({k}, at::kFloat);
    select_top_k(x.data_ptr<float>(), n, k, index.data_ptr<int32_t>(), values.data_ptr<float>());
    if (feedback_) {
      float* e = error.data_ptr<float>();
      for (const int32_t* i = index.data_ptr<int32_t>(); i != index.data_ptr<int32_t>() + k; ++i) {
        e[*i] = 0.0f;
      }
    }
    const int p = comm.size();
    auto all_index = at::empty({p * k}, at::kInt), all_values = at::empty({p * k}, at::kFloat);
    auto w1 = comm.all_gather_into_tensor(all_index, index);
    auto w2 = comm.all_gather_into_tensor(all_values, values);
    w1.wait();
    w2.wait();
    flat.zero_();
    float* out = flat.data_ptr<float>();
    const int32_t* ai = all_index.data_ptr<int32_t>();
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

 private:
  double ratio_;
  bool feedback_;
  std::map<int64_t, at::Tensor> error_;
};

}  // namespace

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
