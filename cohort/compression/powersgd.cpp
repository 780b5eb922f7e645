#include "cohort/compression/powersgd.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <utility>

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"

namespace cohort::compression {
namespace {

// Gram-Schmidt on the columns of each matrix of a batch (b, rows, rank), in
// place. A zero column stays zero (no division by zero).
void orthogonalize(at::Tensor m) {
  const int64_t r = m.size(2);
  for (int64_t i = 0; i < r; ++i) {
    auto col = m.narrow(2, i, 1);
    col.div_(at::norm(col, 2, {1}, true).clamp_min(1e-30));
    if (i + 1 < r) {
      auto rest = m.narrow(2, i + 1, r - i - 1);
      rest.sub_(col * (col * rest).sum(1, true));
    }
  }
}

// Same-shape matrices compressed as one batch.
struct Batch {
  int64_t rows = 0, cols = 0, rank = 0;
  std::vector<at::Tensor> members;  // views of the input, rows x cols
  at::Tensor stacked;               // (b, rows, cols)
  at::Tensor p, q;                  // views into the P and Q memories
};

class PowerSGD : public Compressor {
 public:
  explicit PowerSGD(const CompressionOptions& o) : o_(o) {
    if (o.powersgd_rank < 1) throw InvalidArgument("cohort: PowerSGD needs rank >= 1");
    if (o.powersgd_start_iteration < 0) {
      throw InvalidArgument("cohort: PowerSGD needs start_iteration >= 0");
    }
  }
  std::string name() const override { return "powersgd"; }

  void all_reduce(Communicator& comm, at::Tensor& flat, int64_t key,
                  const std::vector<at::Tensor>& shaped) override {
    int64_t& step = steps_[key];
    if (step < o_.powersgd_start_iteration) {
      comm.all_reduce(flat, {ReduceOp::Avg}).wait();
      ++step;
      return;
    }
    at::Tensor input;
    if (o_.error_feedback) {
      auto& error = errors_[key];
      if (error.defined() && error.numel() == flat.numel()) flat.add_(error);
      input = flat.clone();
    }
    std::vector<at::Tensor> uncompressed;
    auto batches = split(shaped.empty() ? std::vector<at::Tensor>{flat} : shaped, uncompressed);
    prepare_memories(key, step, batches);
    reduce_uncompressed(comm, uncompressed);
    for (auto& b : batches) at::bmm_out(b.p, b.stacked, b.q);
    if (p_.numel() > 0) comm.all_reduce(p_, {ReduceOp::Sum}).wait();
    for (auto& b : batches) {
      orthogonalize(b.p);
      at::bmm_out(b.q, b.stacked.transpose(1, 2), b.p);
    }
    auto& q = q_[key];
    if (q.numel() > 0) comm.all_reduce(q, {ReduceOp::Avg}).wait();
    for (auto& b : batches) {
      auto approx = at::bmm(b.p, b.q.transpose(1, 2));
      for (size_t i = 0; i < b.members.size(); ++i) b.members[i].copy_(approx[i]);
    }
    if (o_.error_feedback) errors_[key] = input.sub_(flat);
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

 private:
  // Matrices worth compressing, batched by shape in order of first
  // appearance; everything else goes to `uncompressed`.
  std::vector<Batch> split(const std::vector<at::Tensor>& tensors,
                           std::vector<at::Tensor>& uncompressed) const {
    std::vector<Batch> batches;
    for (auto& t : tensors) {
      const int64_t rows = t.dim() >= 2 ? t.size(0) : 0;
      const int64_t cols = rows > 0 ? t.numel() / rows : 0;
      const int64_t rank = std::min<int64_t>({rows, cols, o_.powersgd_rank});
      const bool worth =
          t.dim() >= 2 && rank > 0 &&
          static_cast<double>((rows + cols) * rank) * o_.powersgd_min_compression_rate <
              static_cast<double>(rows * cols);
      if (!worth) {
        uncompressed.push_back(t);
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
    }
    for (auto& b : batches) b.stacked = at::stack(b.members);
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
    p_ = at::empty({p_size}, at::kFloat);
    auto& q = q_[key];
    const bool fresh = !q.defined() || q.numel() != q_size;
    if (fresh) {
      auto gen = at::detail::createCPUGenerator(
          static_cast<uint64_t>(o_.powersgd_seed * 1000003 + key * 7919 + step));
      q = at::randn({q_size}, gen, at::TensorOptions().dtype(at::kFloat));
    }
    int64_t po = 0, qo = 0;
    for (auto& b : batches) {
      const int64_t n = static_cast<int64_t>(b.members.size());
      b.p = p_.narrow(0, po, n * b.rows * b.rank).view({n, b.rows, b.rank});
      b.q = q.narrow(0, qo, n * b.cols * b.rank).view({n, b.cols, b.rank});
      po += n * b.rows * b.rank;
      qo += n * b.cols * b.rank;
      orthogonalize(b.q);
    }
  }

  void reduce_uncompressed(Communicator& comm, const std::vector<at::Tensor>& tensors) {
    if (tensors.empty()) return;
    std::vector<at::Tensor> flat;
    for (auto& t : tensors) flat.push_back(t.reshape(-1));
    auto joined = at::cat(flat);
    if (joined.numel() > 0) comm.all_reduce(joined, {ReduceOp::Avg}).wait();
    int64_t off = 0;
    for (auto& t : tensors) {
      t.copy_(joined.narrow(0, off, t.numel()).view(t.sizes()));
      off += t.numel();
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
