#include "cohort/compression/powersgd.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"

namespace cohort::compression {
namespace {

// Gram-Schmidt on the columns of each matrix of a batch (b, rows, rank), in
// place, each column projected off the earlier ones twice. Once is not
// enough where a column is (numerically) a combination of the earlier ones,
// as P = MQ is past the rank of M (a rank-1 gradient at rank 2): what is
// left is rounding noise that still points along them, and normalized it
// counts their direction twice in P Pᵀ M (the average came back up to twice
// its size). The second pass makes the noise orthogonal; a column left with
// under kDependent of its norm is dropped (zero) all the same, as is a zero
// one: a zero column of P adds nothing, and Q's is redrawn (warm start).
void orthogonalize(at::Tensor m) {
  constexpr double kDependent = 1e-4;
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t r = m.size(2);
  for (int64_t i = 0; i < r; ++i) {
    auto col = m.narrow(2, i, 1);
    auto before = at::norm(col, 2, {1}, true);
    if (i > 0) {
      auto done = m.narrow(2, 0, i);  // orthonormal (or zero) columns
      for (int pass = 0; pass < 2; ++pass) {
        col.sub_(at::bmm(done, at::bmm(done.transpose(1, 2), col)));
      }
    }
    auto after = at::norm(col, 2, {1}, true);
    // Dividing by inf zeroes a dropped column (no 0/0).
    col.div_(at::where(after > before * kDependent, after, at::full_like(after, inf)));
  }
}

// The passes over the gradient matrices, as loops over one row at a time (a
// row stays in L1 between the steps of a pass). With error feedback a step
// reads and writes each matrix and its error twice: once to add the error
// and project (P = M Q), once to write the approximation and the new error,
// plus one read for Q = M^T P (BLAS). Separate ATen ops took ~11 passes and
// three bucket-sized temporaries.

// Dot product in eight independent lanes (vectorises without reassociating
// a float reduction).
float dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int l = 0; l < 8; ++l) lane[l] += a[j + l] * b[j + l];
  }
  float s = 0;
  for (; j < n; ++j) s += a[j] * b[j];
  for (float l : lane) s += l;
  return s;
}

// m += error (when given), then p = m Q, row by row: m is rows x cols
// row-major, qt is Q transposed (rank x cols), p is rows x rank.
void add_error_and_project(float* m, const float* error, const float* qt, int64_t rows,
                           int64_t cols, int64_t rank, float* p) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = m + i * cols;
    if (error != nullptr) {
      const float* e = error + i * cols;
      for (int64_t j = 0; j < cols; ++j) row[j] += e[j];
    }
    for (int64_t k = 0; k < rank; ++k) p[i * rank + k] = dot(row, qt + k * cols, cols);
  }
}

// m = p Q^T row by row; with `error` given, error = m - p Q^T first (what
// this step's approximation dropped). `scratch` holds cols floats.
void reconstruct(float* m, float* error, const float* p, const float* qt, int64_t rows,
                 int64_t cols, int64_t rank, float* scratch) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* pi = p + i * rank;
    for (int64_t j = 0; j < cols; ++j) scratch[j] = pi[0] * qt[j];
    for (int64_t k = 1; k < rank; ++k) {
      const float* qk = qt + k * cols;
      for (int64_t j = 0; j < cols; ++j) scratch[j] += pi[k] * qk[j];
    }
    float* row = m + i * cols;
    if (error != nullptr) {
      // A non-finite error (a step with inf or NaN) would be added to every
      // later step: it is dropped, and this step alone carries the value.
      constexpr float kMax = std::numeric_limits<float>::max();
      float* e = error + i * cols;
      for (int64_t j = 0; j < cols; ++j) {
        const float d = row[j] - scratch[j];
        e[j] = std::abs(d) <= kMax ? d : 0.0f;
      }
    }
    std::copy(scratch, scratch + cols, row);
  }
}

// Same-shape matrices compressed as one batch. Members are contiguous views
// of the input, `offsets` their positions in it (and in the error buffer).
// Where they lie at equal distances (a stack of identical layers),
// `stacked` views them all as (b, rows, cols) without a copy and Q = M^T P
// is one batched product.
struct Batch {
  int64_t rows = 0, cols = 0, rank = 0;
  std::vector<at::Tensor> members;
  std::vector<int64_t> offsets;
  at::Tensor stacked;  // (b, rows, cols) view of the input, or undefined
  at::Tensor p, q;     // views into the P and Q memories
};

// A (b, rows, cols) view of the members when they are equally spaced in the
// input; undefined otherwise.
at::Tensor strided_stack(const Batch& b) {
  const int64_t n = static_cast<int64_t>(b.members.size());
  const int64_t spacing = n > 1 ? b.offsets[1] - b.offsets[0] : b.rows * b.cols;
  if (spacing < b.rows * b.cols) return {};
  for (int64_t i = 1; i < n; ++i) {
    if (b.offsets[i] != b.offsets[0] + i * spacing) return {};
  }
  const auto& first = b.members.front();
  return first.as_strided({n, b.rows, b.cols}, {spacing, b.cols, 1}, first.storage_offset());
}

class PowerSGD : public Compressor {
 public:
  explicit PowerSGD(const CompressionOptions& o) : o_(o) {
    if (o.powersgd_rank < 1) throw InvalidArgument("cohort: PowerSGD needs powersgd_rank >= 1");
    if (o.powersgd_start_iteration < 0) {
      throw InvalidArgument("cohort: PowerSGD needs powersgd_start_iteration >= 0");
    }
    // As PyTorch's hook: the error and Q kept from the first iteration would
    // describe DDP's first bucket layout, which the rebuild after it changes.
    if ((o.error_feedback || o.powersgd_warm_start) && o.powersgd_start_iteration <= 1) {
      throw InvalidArgument(
          "cohort: PowerSGD with error_feedback or powersgd_warm_start needs "
          "powersgd_start_iteration > 1 (got " +
          std::to_string(o.powersgd_start_iteration) + ")");
    }
  }
  std::string name() const override { return "powersgd"; }

  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t key,
                  const std::vector<at::Tensor>& shaped) override {
    agree(comm, o_, key, flat.numel(), layout_words(flat, shaped));
    const auto views =
        shaped.empty() ? std::vector<at::Tensor>{flat} : with_gaps(comm, key, flat, shaped);
    int64_t& step = steps_[key];
    if (step < o_.powersgd_start_iteration) {
      comm.all_reduce(flat, {ReduceOp::Avg}).wait();
      ++step;
      return;
    }
    // error: what the last step dropped on the way in, what this one drops
    // on the way out (input - output over the whole tensor, as PyTorch's
    // hook keeps it), updated in place.
    float* error = nullptr;
    bool add_error = false;
    if (o_.error_feedback) {
      auto& e = errors_[key];
      add_error = e.defined() && e.numel() == flat.numel();
      if (!add_error) e = at::zeros_like(flat);
      error = e.data_ptr<float>();
    }
    std::vector<std::pair<at::Tensor, int64_t>> uncompressed;
    auto batches = split(flat, views, uncompressed);
    prepare_memories(key, step, batches);
    reduce_uncompressed(comm, uncompressed, add_error ? error : nullptr, error);
    std::vector<at::Tensor> qts;  // Q transposed per batch, (b, rank, cols)
    for (auto& b : batches) {     // M += error; P = M Q
      qts.push_back(b.q.transpose(1, 2).contiguous());
      for (size_t i = 0; i < b.members.size(); ++i) {
        add_error_and_project(
            b.members[i].data_ptr<float>(), add_error ? error + b.offsets[i] : nullptr,
            qts.back()[i].data_ptr<float>(), b.rows, b.cols, b.rank, b.p[i].data_ptr<float>());
      }
    }
    if (p_.numel() > 0) comm.all_reduce(p_, {ReduceOp::Sum}).wait();
    for (auto& b : batches) {  // Q = M^T orthogonalize(P)
      orthogonalize(b.p);
      if (b.stacked.defined()) {
        at::bmm_out(b.q, b.stacked.transpose(1, 2), b.p);
      } else {
        for (size_t i = 0; i < b.members.size(); ++i) {
          auto qi = b.q[i];
          at::mm_out(qi, b.members[i].t(), b.p[i]);
        }
      }
    }
    auto& q = q_[key];
    if (q.numel() > 0) comm.all_reduce(q, {ReduceOp::Avg}).wait();
    std::vector<float> scratch;
    for (auto& b : batches) {  // M = P Q^T; error = M before - M after
      auto qt = b.q.transpose(1, 2).contiguous();
      scratch.resize(b.cols);
      for (size_t i = 0; i < b.members.size(); ++i) {
        reconstruct(b.members[i].data_ptr<float>(), error ? error + b.offsets[i] : nullptr,
                    b.p[i].data_ptr<float>(), qt[i].data_ptr<float>(), b.rows, b.cols, b.rank,
                    scratch.data());
      }
    }
    if (!o_.powersgd_warm_start) q_.erase(key);
    ++step;
  }

  std::map<std::string, at::Tensor> state() const override {
    std::map<std::string, at::Tensor> s;
    for (auto& [k, t] : errors_) s["powersgd_error_" + std::to_string(k)] = t.clone();
    for (auto& [k, t] : q_) s["powersgd_q_" + std::to_string(k)] = t.clone();
    for (auto& [k, n] : steps_)
      s["powersgd_step_" + std::to_string(k)] = at::scalar_tensor(n, at::kLong);
    return s;
  }
  void load_state(const std::map<std::string, at::Tensor>& s) override {
    errors_.clear();
    q_.clear();
    steps_.clear();
    for (auto& [name, t] : s) {
      auto key_of = [&](const std::string& prefix) {
        return std::stoll(name.substr(prefix.size()));
      };
      if (name.rfind("powersgd_error_", 0) == 0) errors_[key_of("powersgd_error_")] = t.clone();
      if (name.rfind("powersgd_q_", 0) == 0) q_[key_of("powersgd_q_")] = t.clone();
      if (name.rfind("powersgd_step_", 0) == 0)
        steps_[key_of("powersgd_step_")] = t.item<int64_t>();
    }
  }

 protected:
  void forget(int64_t key) override {
    errors_.erase(key);
    q_.erase(key);
  }
  // The error alone: Q is a starting point of the power iteration shared by
  // every rank, not a value owed to a gradient.
  std::vector<at::Tensor> element_state(int64_t key, const ElementRange& range, int, int) override {
    const auto it = errors_.find(key);
    if (it == errors_.end() || !it->second.defined() ||
        it->second.numel() < range.offset + range.count) {
      return {};
    }
    return {it->second.narrow(0, range.offset, range.count)};
  }

 private:
  // What decides the batches: each view's offset and shape. Ranks whose
  // views differ would all-reduce P and Q of different sizes.
  static std::vector<int64_t> layout_words(const at::Tensor& flat,
                                           const std::vector<at::Tensor>& shaped) {
    std::vector<int64_t> words;
    for (auto& t : shaped) {
      words.push_back(t.storage_offset() - flat.storage_offset());
      words.push_back(t.dim());
      for (auto s : t.sizes()) words.push_back(s);
    }
    return words;
  }

  // Position of `t` in `flat` (t must be a contiguous float32 view of it).
  static int64_t offset_in(const at::Tensor& flat, const at::Tensor& t) {
    const int64_t off = t.storage_offset() - flat.storage_offset();
    if (!t.is_contiguous() || t.scalar_type() != at::kFloat ||
        !t.storage().is_alias_of(flat.storage()) || off < 0 || off + t.numel() > flat.numel()) {
      throw InvalidArgument(
          "cohort: PowerSGD's shaped tensors must be contiguous float32 views of the flat one");
    }
    return off;
  }

  // `shaped` and, as vectors, the runs of elements of `flat` in none of them,
  // so that those are averaged (uncompressed) too instead of keeping this
  // rank's values. Views that overlap would be reduced, and given their
  // error, twice: refused, on every rank alike (the layouts agreed).
  static std::vector<at::Tensor> with_gaps(const Communicator& comm, int64_t key,
                                           const at::Tensor& flat,
                                           const std::vector<at::Tensor>& shaped) {
    std::vector<std::pair<int64_t, int64_t>> ranges;  // (offset, count)
    for (auto& t : shaped) {
      if (t.numel() > 0) ranges.emplace_back(offset_in(flat, t), t.numel());
    }
    std::sort(ranges.begin(), ranges.end());
    std::vector<at::Tensor> out = shaped;
    int64_t covered = 0;  // the elements before it are in a view
    for (auto [offset, count] : ranges) {
      if (offset < covered) {
        throw InvalidArgument("cohort: PowerSGD on rank " + std::to_string(comm.rank()) + " of " +
                              std::to_string(comm.size()) + " (group " + comm.name() +
                              ", tensor key " + std::to_string(key) +
                              "): shaped tensors overlap at element " + std::to_string(offset) +
                              " of the flat one; each element may be in one view only");
      }
      if (offset > covered) out.push_back(flat.narrow(0, covered, offset - covered));
      covered = offset + count;
    }
    if (covered < flat.numel()) out.push_back(flat.narrow(0, covered, flat.numel() - covered));
    return out;
  }

  // Matrices worth compressing, batched by shape in order of first
  // appearance; everything else goes to `uncompressed`, with its offset.
  std::vector<Batch> split(const at::Tensor& flat, const std::vector<at::Tensor>& tensors,
                           std::vector<std::pair<at::Tensor, int64_t>>& uncompressed) const {
    std::vector<Batch> batches;
    for (auto& t : tensors) {
      const int64_t offset = offset_in(flat, t);
      const int64_t rows = t.dim() >= 2 ? t.size(0) : 0;
      const int64_t cols = rows > 0 ? t.numel() / rows : 0;
      const int64_t rank = std::min<int64_t>({rows, cols, o_.powersgd_rank});
      const bool worth =
          t.dim() >= 2 && rank > 0 &&
          static_cast<double>((rows + cols) * rank) * o_.powersgd_min_compression_rate <
              static_cast<double>(rows * cols);
      if (!worth) {
        uncompressed.emplace_back(t, offset);
        continue;
      }
      auto it = std::find_if(batches.begin(), batches.end(),
                             [&](const Batch& b) { return b.rows == rows && b.cols == cols; });
      if (it == batches.end()) {
        Batch b;
        b.rows = rows;
        b.cols = cols;
        b.rank = rank;
        it = batches.insert(batches.end(), std::move(b));
      }
      it->members.push_back(t.view({rows, cols}));
      it->offsets.push_back(offset);
    }
    for (auto& b : batches) b.stacked = strided_stack(b);
    return batches;
  }

  // P and Q memories of this key, viewed per batch. Q is kept from the last
  // step (warm start) or drawn afresh from the shared seed.
  void prepare_memories(int64_t key, int64_t step, std::vector<Batch>& batches) {
    int64_t p_size = 0, q_size = 0;
    for (auto& b : batches) {
      p_size += b.members.size() * b.rows * b.rank;
      q_size += b.members.size() * b.cols * b.rank;
    }
    if (p_.numel() != p_size) p_ = at::empty({p_size}, at::kFloat);
    auto& q = q_[key];
    const bool fresh = !q.defined() || q.numel() != q_size;
    auto draw = [&] {
      auto gen = at::detail::createCPUGenerator(
          static_cast<uint64_t>(o_.powersgd_seed * 1000003 + key * 7919 + step));
      return at::randn({q_size}, gen, at::TensorOptions().dtype(at::kFloat));
    };
    if (fresh) q = draw();
    at::Tensor drawn;  // drawn once, only when some column needs it
    int64_t po = 0, qo = 0;
    for (auto& b : batches) {
      const int64_t n = static_cast<int64_t>(b.members.size());
      b.p = p_.narrow(0, po, n * b.rows * b.rank).view({n, b.rows, b.rank});
      b.q = q.narrow(0, qo, n * b.cols * b.rank).view({n, b.cols, b.rank});
      if (!fresh) redraw_degenerate_columns(b.q, qo, drawn, draw);
      po += n * b.rows * b.rank;
      qo += n * b.cols * b.rank;
      orthogonalize(b.q);
    }
  }

  // A warm-start column that is zero (the last step's gradient was, as a
  // frozen layer's is) or not finite (it held inf or NaN) would stay so for
  // good: P = M Q would be zero or NaN at every later step. Such columns are
  // drawn afresh from the shared seed; Q is the same on every rank (an
  // all-reduce's result), so every rank redraws the same ones.
  template <typename Draw>
  static void redraw_degenerate_columns(at::Tensor& q, int64_t offset, at::Tensor& drawn,
                                        Draw& draw) {
    // One norm per column: (n, 1, rank).
    auto norms = at::linalg_vector_norm(q, 2, at::IntArrayRef{1}, /*keepdim=*/true);
    auto degenerate = at::isfinite(norms).logical_not().logical_or(norms.eq(0));
    if (!degenerate.any().item<bool>()) return;
    if (!drawn.defined()) drawn = draw();
    auto fresh = drawn.narrow(0, offset, q.numel()).view(q.sizes());
    q.copy_(at::where(degenerate, fresh, q));
  }

  // Averages the tensors not worth compressing in one all-reduce; with
  // error feedback, adds `add` (the last step's error) first and stores
  // input - average into `error` (both indexed by the tensors' offsets).
  void reduce_uncompressed(Communicator& comm,
                           const std::vector<std::pair<at::Tensor, int64_t>>& tensors,
                           const float* add, float* error) {
    if (tensors.empty()) return;
    auto error_of = [](float* base, const at::Tensor& t, int64_t off) {
      return at::from_blob(base + off, {t.numel()}, at::kFloat);
    };
    std::vector<at::Tensor> flat;
    for (auto& [t, off] : tensors) {
      auto v = t.reshape(-1);
      if (add != nullptr) v.add_(error_of(const_cast<float*>(add), t, off));
      flat.push_back(v);
    }
    auto joined = at::cat(flat);
    if (joined.numel() > 0) comm.all_reduce(joined, {ReduceOp::Avg}).wait();
    int64_t pos = 0;
    for (auto& [t, off] : tensors) {
      auto average = joined.narrow(0, pos, t.numel());
      if (error != nullptr) {
        auto dropped = error_of(error, t, off);
        at::sub_out(dropped, t.reshape(-1), average);
        dropped.nan_to_num_(0, 0, 0);  // as reconstruct(): no non-finite error
      }
      t.copy_(average.view(t.sizes()));
      pos += t.numel();
    }
  }

  CompressionOptions o_;
  std::map<int64_t, at::Tensor> errors_, q_;
  std::map<int64_t, int64_t> steps_;
  at::Tensor p_;
};

}  // namespace

std::unique_ptr<Compressor> make_powersgd(const CompressionOptions& options) {
  return std::make_unique<PowerSGD>(options);
}

}  // namespace cohort::compression
