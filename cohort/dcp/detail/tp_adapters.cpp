#include "cohort/dcp/detail/tp_adapters.h"

#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/detail/optimizer_slots.h"
#include "cohort/tensor_parallel/layers.h"

namespace cohort::dcp::detail {
namespace {

// Loading: "" when the checkpoint's `fqn` can be split along `dim` over tp.
std::string layout_error(const Metadata& meta, const std::string& fqn, int64_t dim, int tp,
                         int rank) {
  const auto* t = meta.find(fqn);
  if (!t || static_cast<int64_t>(t->shape.size()) <= dim || t->shape[dim] % tp == 0) return "";
  return "dcp::tensor_parallel_state_dict (rank " + std::to_string(rank) + "): tensor " + fqn +
         ": dim " + std::to_string(dim) + " of the checkpoint's shape " + shape_string(t->shape) +
         " does not divide by the tensor-parallel size " + std::to_string(tp) +
         "; this layout cannot hold it";
}

}  // namespace

StateDict tensor_parallel_state_dict(torch::nn::Module& stage, const DeviceMesh& mesh,
                                     torch::optim::Optimizer* optimizer, const TiedNames& tied,
                                     const Metadata* for_load) {
  const auto dims = tensor_parallel::split_dims(stage);
  const int tp = mesh.size("tp"), dp = mesh.size("dp");
  const int tp_rank = mesh.local_rank("tp"), dp_rank = mesh.local_rank("dp");
  StateDict state;
  std::vector<ParamSlot> slots;
  std::string error;
  // Tensor i is written by DP replica i % dp, and when it is whole also
  // only by TP rank (i / dp) % tp: the same i on every rank of the stage.
  int64_t i = 0;
  auto writes = [&](bool sharded) {
    const auto k = i++;
    if (k % dp != dp_rank) return false;
    return sharded || (k / dp) % tp == tp_rank;
  };
  for (const auto& p : stage.named_parameters()) {
    const auto tie = tied.find(p.key());
    const bool copy = tie != tied.end();
    const auto& name = copy ? tie->second : p.key();
    const auto it = dims.find(p.value().unsafeGetTensorImpl());
    const int64_t dim = it == dims.end() || tp == 1 ? -1 : it->second;
    const bool mine = writes(dim >= 0) && !copy;
    if (for_load && dim >= 0 && error.empty()) {
      error = layout_error(*for_load, "model." + name, dim, tp, mesh.rank());
    }
    auto shape = p.value().sizes().vec();
    Box box = whole(shape);
    if (dim >= 0) {
      shape[dim] *= tp;
      box.offsets[dim] = tp_rank * box.lengths[dim];
    }
    state.tensors.push_back(
        {"model." + name, shape, p.value().scalar_type(), false, {{box, p.value()}}, mine});
    slots.push_back({name, shape, p.value(), {box}, {0}, false, dim < 0 || tp_rank == 0, mine});
  }
  for (const auto& b : stage.named_buffers()) {
    state.tensors.push_back({"model." + b.key(),
                             b.value().sizes().vec(),
                             b.value().scalar_type(),
                             false,
                             {{whole(b.value().sizes().vec()), b.value()}},
                             writes(false)});
  }
  for (const auto& m : stage.named_modules("", /*include_self=*/false)) {
    state.modules.push_back("model." + m.key());
  }
  if (for_load) agree(*mesh.process_group(), error);
  if (optimizer) add_optimizer_state(state, *optimizer, slots, for_load);
  if (!for_load) {
    state.load_targets = [&stage, &mesh, optimizer, tied](const Metadata& meta) {
      return tensor_parallel_state_dict(stage, mesh, optimizer, tied, &meta);
    };
  }
  return state;
}

}  // namespace cohort::dcp::detail
