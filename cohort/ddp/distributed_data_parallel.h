// defines: DistributedDataParallel<ModuleHolder>, data parallel training of
// any torch::nn::Module over a cohort Communicator (PyTorch's DDP in C++).
//
//   auto comm = cohort::init();
//   cohort::DistributedDataParallel<Net> ddp(Net(), comm);
//   torch::optim::SGD opt(ddp.parameters(), 0.1);
//   // Each rank reads its own shard (LibTorch's sampler, no new one needed):
//   auto data = torch::data::make_data_loader(
//       dataset, torch::data::samplers::DistributedRandomSampler(
//                    dataset.size().value(), comm->size(), comm->rank()),
//       batch_size);
//   for (auto& batch : *data) {
//     opt.zero_grad();
//     auto loss = loss_fn(ddp.forward(batch.data), batch.target);
//     loss.backward();   // buckets are all-reduced during backward
//     opt.step();        // every rank applies the same averaged gradient
//   }
//
// The template is a thin layer so that forward() keeps the module's own
// signature; all the work is in the non-template GradientReducer.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <exception>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"
#include "cohort/grad_sync/comm_hook.h"
#include "cohort/grad_sync/ddp_options.h"
#include "cohort/grad_sync/ddp_stats.h"
#include "cohort/grad_sync/gradient_reducer.h"
#include "cohort/grad_sync/no_sync_guard.h"
#include "cohort/mesh/device_mesh.h"

namespace cohort {
namespace detail {

template <typename T>
struct IsSharedPtr : std::false_type {};
template <typename T>
struct IsSharedPtr<std::shared_ptr<T>> : std::true_type {};

/// A TORCH_MODULE holder or a std::shared_ptr to a module, as the base type.
template <typename ModuleHolder>
std::shared_ptr<torch::nn::Module> as_module_ptr(const ModuleHolder& holder) {
  if constexpr (IsSharedPtr<ModuleHolder>::value) {
    return std::static_pointer_cast<torch::nn::Module>(holder);
  } else {
    return std::static_pointer_cast<torch::nn::Module>(holder.ptr());
  }
}

/// The tensors a forward returned, for the unused-parameter search: a tensor,
/// a vector of tensors, or a tuple/pair of those. Other types contribute none
/// (unused parameters are then found when backward ends).
inline void collect_tensors(const torch::Tensor& t, std::vector<torch::Tensor>& out) {
  out.push_back(t);
}
inline void collect_tensors(const std::vector<torch::Tensor>& ts, std::vector<torch::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<torch::Tensor>& out);
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& p, std::vector<torch::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <typename T>
void collect_tensors(const T&, std::vector<torch::Tensor>&) {}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<torch::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect_tensors(e, out), ...); }, t);
}

}  // namespace detail

/// Data parallel training of a torch::nn::Module (PyTorch's DistributedDataParallel): each rank
/// runs forward and backward on its own batch, and backward averages the gradients over the
/// communicator, so every rank's optimizer step applies the same update. See the file comment for a
/// training loop.
template <typename ModuleHolder>
class DistributedDataParallel {
 public:
  /// Collective over comm (see GradientReducer's constructor).
  DistributedDataParallel(ModuleHolder module, std::shared_ptr<Communicator> comm,
                          DDPOptions options = {})
      : module_(std::move(module)),
        reducer_(std::make_unique<GradientReducer>(detail::as_module_ptr(module_), std::move(comm),
                                                   options)) {
    if (options.compression.kind != compression::CompressionKind::None) {
      register_comm_hook(std::make_shared<CompressionHook>(options.compression));
    }
  }

  /// Over a 1-D mesh (PyTorch's DDP with device_mesh): its group; InvalidArgument naming
  /// the mesh when it has more dimensions. Collective over it.
  DistributedDataParallel(ModuleHolder module, const DeviceMesh& mesh, DDPOptions options = {})
      : DistributedDataParallel(std::move(module),
                                one_dimension_group(mesh, "DistributedDataParallel", "dp"),
                                std::move(options)) {}

  /// Pre-forward work (previous iteration check, bucket rebuild, buffer
  /// broadcast), the module's own forward, then the unused-parameter search.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    reducer_->prepare_forward();
    ForwardFailure on_throw{*reducer_};
    decltype(auto) out = module_->forward(std::forward<Args>(args)...);
    std::vector<torch::Tensor> tensors;
    if (reducer_->options().find_unused_parameters) detail::collect_tensors(out, tensors);
    reducer_->after_forward(tensors);
    return out;
  }

  /// The wrapped module (parameters and buffers are the module's own).
  ModuleHolder& module() { return module_; }
  /// The communicator the gradients are reduced over.
  const std::shared_ptr<Communicator>& process_group() const { return reducer_->process_group(); }

  /// Module-holder syntax, as every LibTorch module: `ddp->forward(x)`,
  /// `ddp->zero_grad()`, `ddp->parameters()` compile where the bare module's
  /// holder was used, so wrapping changes no call site.
  DistributedDataParallel* operator->() { return this; }
  /// Module-holder syntax on a const wrapper (`ddp->is_training()`).
  const DistributedDataParallel* operator->() const { return this; }

  // What users expect of a module, forwarded to the wrapped one. Names carry
  // no "module." prefix (unlike PyTorch's DDP state_dict): a checkpoint
  // saved through DDP loads into the bare module and the other way round.
  // There is no to(): the buckets, hooks and the construction-time check are
  // built for the parameters' dtypes and device, so convert the module
  // before wrapping it (PyTorch's DDP gives the same advice).

  /// The module's parameters (recursively by default).
  std::vector<torch::Tensor> parameters(bool recurse = true) {
    return module_->parameters(recurse);
  }
  /// The module's parameters with their qualified names.
  torch::OrderedDict<std::string, torch::Tensor> named_parameters(bool recurse = true) {
    return module_->named_parameters(recurse);
  }
  /// The module's buffers (BatchNorm running statistics, ...).
  std::vector<torch::Tensor> buffers(bool recurse = true) { return module_->buffers(recurse); }
  /// The module's buffers with their qualified names.
  torch::OrderedDict<std::string, torch::Tensor> named_buffers(bool recurse = true) {
    return module_->named_buffers(recurse);
  }
  /// Training mode on (or off) for the module and its children.
  void train(bool on = true) { module_->train(on); }
  /// Evaluation mode; the next forward after a training step still
  /// re-broadcasts buffers from rank 0, as PyTorch's DDP does.
  void eval() { module_->eval(); }
  /// Whether the module is in training mode.
  bool is_training() const { return module_->is_training(); }
  /// The module's zero_grad, with this LibTorch's default for set_to_none.
  void zero_grad() { module_->zero_grad(); }
  /// The module's zero_grad; DDP's hooks handle gradients set to none.
  void zero_grad(bool set_to_none) { module_->zero_grad(set_to_none); }
  /// Saves the module's parameters and buffers (same names as the module).
  void save(torch::serialize::OutputArchive& archive) const { module_->save(archive); }
  /// Loads parameters and buffers into the module; DDP's hooks follow the
  /// loaded tensors. Every rank should load the same state: nothing is
  /// broadcast until the next forward's buffer broadcast.
  void load(torch::serialize::InputArchive& archive) { module_->load(archive); }

  /// RAII: gradients accumulate locally while the guard lives.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*reducer_); }
  /// Reduces gradient buckets with `hook` instead of all_reduce(Avg) from the next backward on
  /// (null throws InvalidArgument). Every rank registers an equivalent hook.
  void register_comm_hook(std::shared_ptr<CommHook> hook) {
    reducer_->register_comm_hook(hook);
    hook_ = std::move(hook);
  }
  /// The hook registered last (DDPOptions::compression's included); null
  /// while the default all-reduce runs.
  const std::shared_ptr<CommHook>& comm_hook() const { return hook_; }
  /// What DDP measured about its gradient reduction (iterations, buckets, bytes, time).
  const DDPStats& stats() const { return reducer_->stats(); }
  /// Determinism::WorldSizeInvariant: this rank's first leaf of the global batch; run one forward
  /// and one backward per leaf, leaves first_leaf() .. first_leaf() + local_leaves() - 1 in order.
  int64_t first_leaf() const { return reducer_->first_leaf(); }
  /// How many leaves this rank computes per step (leaves / world size; 1 without the option).
  int64_t local_leaves() const { return reducer_->local_leaves(); }
  /// The gradient reducer (bucket layout, synchronize(), reduction owner for ZeRO-2).
  GradientReducer& reducer() { return *reducer_; }

 private:
  // Tells the reducer when the module's forward threw (it unwinds past
  // forward() without after_forward()).
  struct ForwardFailure {
    GradientReducer& reducer;
    int before = std::uncaught_exceptions();
    ~ForwardFailure() {
      if (std::uncaught_exceptions() > before) reducer.forward_failed();
    }
  };

  ModuleHolder module_;
  /// Behind a pointer: the accumulator hooks hold its address.
  std::unique_ptr<GradientReducer> reducer_;
  std::shared_ptr<CommHook> hook_;
};

/// `torch::save(ddp, path)`: the module's state under its own names, so the
/// file loads into the bare module and the other way round.
template <typename M>
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const DistributedDataParallel<M>& ddp) {
  ddp.save(archive);
  return archive;
}

/// `torch::load(ddp, path)`: loads into the wrapped module (see load()).
template <typename M>
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           DistributedDataParallel<M>& ddp) {
  ddp.load(archive);
  return archive;
}

}  // namespace cohort
