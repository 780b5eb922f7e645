// The tensor-parallel layers: shard the tp = 1 weights, then wrap the local
// matmul or lookup in the region mappings (mappings.h).
#include "cohort/tensor_parallel/layers.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "cohort/core/error.h"
#include "cohort/tensor_parallel/mappings.h"

namespace cohort::tensor_parallel {

namespace {

void check_divisible(const char* layer, const char* what, int64_t n, const Communicator& g) {
  if (n % g.size() != 0) {
    throw InvalidArgument(std::string("cohort: ") + layer + " (rank " + std::to_string(g.rank()) +
                          "): " + what + " = " + std::to_string(n) +
                          " does not divide by the tensor-parallel size " +
                          std::to_string(g.size()));
  }
}

std::shared_ptr<Communicator> checked(std::shared_ptr<Communicator> g, const char* layer) {
  if (!g) throw InvalidArgument(std::string("cohort: ") + layer + ": the TP group is null");
  return g;
}

// A 1-D mesh named "tp" over `g` (the deprecated group constructors).
DeviceMesh tp_mesh(std::shared_ptr<Communicator> g, const char* layer) {
  return DeviceMesh::from_group(checked(std::move(g), layer), "tp");
}

// The seed of a layer's full weights: `seed`, or one drawn on every rank of
// `g`, the smallest of the group's draws (file comment).
uint64_t agreed_seed(const std::optional<uint64_t>& seed, Communicator& g) {
  return seed ? *seed : smallest_over(draw_seed(), g);
}

}  // namespace

uint64_t draw_seed() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
}

// Every rank drew though one value is kept: a rank that skipped the draw
// would fall behind peers whose generators agreed with its own. The
// smallest, not rank 0's: ranks as threads share one generator, and which of
// them draws first is a race, while the round's set of draws is not.
uint64_t smallest_over(uint64_t mine, Communicator& g) {
  if (g.size() == 1) return mine;
  auto all = torch::empty({g.size()}, torch::kInt64);
  g.all_gather_into_tensor(all, torch::tensor({static_cast<int64_t>(mine)}, torch::kInt64)).wait();
  const auto* drawn = all.data_ptr<int64_t>();
  uint64_t smallest = static_cast<uint64_t>(drawn[0]);
  for (int r = 1; r < g.size(); ++r) smallest = std::min(smallest, static_cast<uint64_t>(drawn[r]));
  return smallest;
}

std::pair<torch::Tensor, torch::Tensor> master_linear_weights(int64_t in, int64_t out,
                                                              uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  const double bound = in > 0 ? 1.0 / std::sqrt(static_cast<double>(in)) : 0.0;
  auto w = torch::empty({out, in}).uniform_(-bound, bound, gen);
  auto b = torch::empty({out}).uniform_(-bound, bound, gen);
  return {w, b};
}

torch::Tensor master_embedding_weight(int64_t n, int64_t dim,
                                      const VocabParallelEmbeddingOptions& o) {
  if (!o.seed) {
    throw InvalidArgument(
        "cohort: master_embedding_weight: options.seed is unset (pass the layer's seed())");
  }
  auto gen = at::detail::createCPUGenerator(*o.seed);
  return torch::empty({n, dim}).normal_(0.0, o.init_std, gen);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(std::shared_ptr<Communicator> g, int64_t in,
                                                   int64_t out, ColumnParallelLinearOptions o)
    : ColumnParallelLinearImpl(tp_mesh(std::move(g), "ColumnParallelLinear"), in, out, o) {}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const DeviceMesh& tp, int64_t in, int64_t out,
                                                   ColumnParallelLinearOptions o)
    : group_(one_dimension_group(tp, "ColumnParallelLinear", "tp")),
      options_(o),
      in_(in),
      out_(out) {
  check_divisible("ColumnParallelLinear", "out_features", out, *group_);
  seed_ = agreed_seed(o.seed, *group_);
  reset();
}

void ColumnParallelLinearImpl::reset() {
  auto [w, b] = master_linear_weights(in_, out_, seed_);
  const int r = group_->rank(), n = group_->size();
  weight = register_parameter("weight", split_along(w, 0, r, n, "ColumnParallelLinear").clone());
  bias = options_.bias
             ? register_parameter("bias", split_along(b, 0, r, n, "ColumnParallelLinear").clone())
             : torch::Tensor();
  mark_tensor_parallel_split(*this, *group_);
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  auto input = options_.sequence_parallel ? gather_from_sequence_parallel_region(x, *group_)
                                          : copy_to_tensor_parallel_region(x, *group_);
  auto y = torch::linear(input, weight, bias);
  return options_.gather_output ? gather_from_tensor_parallel_region(y, *group_) : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(std::shared_ptr<Communicator> g, int64_t in,
                                             int64_t out, RowParallelLinearOptions o)
    : RowParallelLinearImpl(tp_mesh(std::move(g), "RowParallelLinear"), in, out, o) {}

RowParallelLinearImpl::RowParallelLinearImpl(const DeviceMesh& tp, int64_t in, int64_t out,
                                             RowParallelLinearOptions o)
    : group_(one_dimension_group(tp, "RowParallelLinear", "tp")), options_(o), in_(in), out_(out) {
  check_divisible("RowParallelLinear", "in_features", in, *group_);
  if (o.sequence_parallel && !o.input_is_parallel) {
    throw InvalidArgument("cohort: RowParallelLinear: sequence_parallel needs input_is_parallel");
  }
  seed_ = agreed_seed(o.seed, *group_);
  reset();
}

void RowParallelLinearImpl::reset() {
  auto [w, b] = master_linear_weights(in_, out_, seed_);
  weight = register_parameter(
      "weight", split_along(w, 1, group_->rank(), group_->size(), "RowParallelLinear").clone());
  bias = options_.bias ? register_parameter("bias", b) : torch::Tensor();
  mark_tensor_parallel_split(*this, *group_);
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  auto input = options_.input_is_parallel ? x : scatter_to_tensor_parallel_region(x, *group_);
  auto partial = torch::matmul(input, weight.t());
  auto y = options_.sequence_parallel ? reduce_scatter_to_sequence_parallel_region(partial, *group_)
                                      : reduce_from_tensor_parallel_region(partial, *group_);
  return bias.defined() ? y + bias : y;
}

std::vector<TensorParallelSplit> ColumnParallelLinearImpl::tensor_parallel_splits() const {
  if (bias.defined()) return {{weight, 0}, {bias, 0}};
  return {{weight, 0}};
}

std::vector<TensorParallelSplit> RowParallelLinearImpl::tensor_parallel_splits() const {
  return {{weight, 1}};
}

std::vector<TensorParallelSplit> VocabParallelEmbeddingImpl::tensor_parallel_splits() const {
  return {{weight, 0}};
}

std::vector<torch::Tensor> RowParallelLinearImpl::sequence_parallel_parameters() const {
  if (options_.sequence_parallel && bias.defined()) return {bias};
  return {};
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(std::shared_ptr<Communicator> g, int64_t n,
                                                       int64_t dim, VocabParallelEmbeddingOptions o)
    : VocabParallelEmbeddingImpl(tp_mesh(std::move(g), "VocabParallelEmbedding"), n, dim, o) {}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const DeviceMesh& tp, int64_t n, int64_t dim,
                                                       VocabParallelEmbeddingOptions o)
    : group_(one_dimension_group(tp, "VocabParallelEmbedding", "tp")),
      num_embeddings_(n),
      embedding_dim_(dim),
      options_(o) {
  check_divisible("VocabParallelEmbedding", "num_embeddings", n, *group_);
  start_ = group_->rank() * (n / group_->size());
  end_ = start_ + n / group_->size();
  seed_ = agreed_seed(o.seed, *group_);
  reset();
}

void VocabParallelEmbeddingImpl::reset() {
  auto o = options_;
  o.seed = seed_;
  auto w = master_embedding_weight(num_embeddings_, embedding_dim_, o);
  weight = register_parameter("weight", w.narrow(0, start_, end_ - start_).clone());
  mark_tensor_parallel_split(*this, *group_);
}

// The ids are the same on every TP rank, so each finds the same bad one
// here, before the all-reduce: all ranks throw, none waits for the others.
// (Without the check an id beyond the table would look up zeros on every
// rank at tp > 1.)
void VocabParallelEmbeddingImpl::check_ids(const torch::Tensor& ids) const {
  auto flat = ids.reshape({-1});
  auto bad = flat.lt(0).logical_or(flat.ge(num_embeddings_));
  if (!bad.any().item<bool>()) return;
  const int64_t i = bad.nonzero()[0][0].item<int64_t>();
  throw InvalidArgument("cohort: VocabParallelEmbedding (rank " + std::to_string(group_->rank()) +
                        " of " + std::to_string(group_->size()) + " in the TP group): id " +
                        std::to_string(flat[i].item<int64_t>()) + " at index " + std::to_string(i) +
                        " is outside [0, " + std::to_string(num_embeddings_) +
                        ") (num_embeddings)");
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& ids) {
  check_ids(ids);
  if (group_->size() == 1) {
    return reduce_from_tensor_parallel_region(torch::embedding(weight, ids), *group_);
  }
  auto outside = (ids < start_).logical_or(ids >= end_);
  auto local = (ids - start_).masked_fill(outside, 0);
  auto rows = torch::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0.0);
  return reduce_from_tensor_parallel_region(rows, *group_);
}

namespace {

std::string split_dims_who(const std::string& name) {
  return "cohort: tensor_parallel::split_dims: the TensorParallelModule '" +
         (name.empty() ? std::string("(the root)") : name) + "' ";
}

}  // namespace

std::map<const void*, int64_t> split_dims(torch::nn::Module& module) {
  std::map<const void*, int64_t> dims;
  auto visit = [&](const std::string& name, torch::nn::Module& m) {
    const auto* layer = dynamic_cast<const TensorParallelModule*>(&m);
    if (!layer) return;
    const auto group = layer->tensor_parallel_group();
    if (!group) throw InvalidArgument(split_dims_who(name) + "has no tensor_parallel_group");
    // Over a group of one rank a layer holds its whole tensors.
    if (group->size() == 1) return;
    for (const auto& s : layer->tensor_parallel_splits()) {
      if (!s.parameter.defined()) continue;  // an optional one left out (a bias)
      // A dimension the parameter lacks would cut every consumer's boxes
      // wrong; the check is local and alike on every rank of one model.
      if (s.dim < 0 || s.dim >= s.parameter.dim()) {
        throw InvalidArgument(split_dims_who(name) + "splits a " +
                              std::to_string(s.parameter.dim()) + "-D parameter along dimension " +
                              std::to_string(s.dim));
      }
      dims[s.parameter.unsafeGetTensorImpl()] = s.dim;
    }
  };
  // The root by address: modules() with itself needs it held by a shared_ptr.
  visit("", module);
  for (const auto& m : module.named_modules("", /*include_self=*/false)) visit(m.key(), *m.value());
  return dims;
}

}  // namespace cohort::tensor_parallel
