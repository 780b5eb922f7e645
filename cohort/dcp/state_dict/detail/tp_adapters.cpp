#include "cohort/dcp/state_dict/detail/tp_adapters.h"

#include <set>
#include <string>

#include "cohort/core/error.h"
#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/state_dict/detail/adapters.h"
#include "cohort/dcp/state_dict/detail/optimizer_slots.h"
#include "cohort/expert_parallel/moe.h"
#include "cohort/tensor_parallel/layers.h"

namespace cohort::dcp::detail {
namespace {

// Loading: "" when the checkpoint's `fqn` can be split along `dim` over tp.
std::string layout_error(const Metadata& meta, const std::string& fqn, int64_t dim, int tp,
                         int rank, const char* what = "tensor-parallel") {
  const auto* t = meta.find(fqn);
  if (!t || static_cast<int64_t>(t->shape.size()) <= dim || t->shape[dim] % tp == 0) return "";
  return "dcp::tensor_parallel_state_dict (rank " + std::to_string(rank) + "): tensor " + fqn +
         ": dim " + std::to_string(dim) + " of the checkpoint's shape " + shape_string(t->shape) +
         " does not divide by the " + what + " size " + std::to_string(tp) +
         "; this layout cannot hold it";
}

int size_or_one(const DeviceMesh& mesh, const std::string& name) {
  for (const auto& n : mesh.dim_names()) {
    if (n == name) return mesh.size(name);
  }
  return 1;
}

// Which of the ranks holding the same box writes tensor k: the holders are
// the ranks that differ only along the dimensions that replicate it (dp, cp,
// and ep and tp where they do not split it); they take turns tensor by
// tensor, so every element is written once.
class Writers {
 public:
  explicit Writers(const DeviceMesh& mesh) : mesh_(mesh) {}
  bool writes(int64_t k, bool split_over_tp, bool split_over_ep) const {
    int64_t index = 0, count = 1;
    for (const auto& name : mesh_.dim_names()) {
      if (name == "pp" || (name == "tp" && split_over_tp) || (name == "ep" && split_over_ep)) {
        continue;
      }
      index = index * mesh_.size(name) + mesh_.local_rank(name);
      count *= mesh_.size(name);
    }
    return k % count == index;
  }

 private:
  const DeviceMesh& mesh_;
};

}  // namespace

std::string moe_groups_error(const torch::nn::Module& stage, const DeviceMesh& mesh) {
  const auto mismatch = expert_parallel::mesh_mismatch(stage, mesh);
  return mismatch.empty() ? mismatch : "dcp::get_state_dict: " + mismatch;
}

void agree_moe_groups(const torch::nn::Module& stage, const DeviceMesh& mesh) {
  agree(*mesh.process_group(), moe_groups_error(stage, mesh), ErrorKind::InvalidArgument);
}

StateDict tensor_parallel_state_dict(torch::nn::Module& stage, const DeviceMesh& mesh,
                                     torch::optim::Optimizer* optimizer, const TiedNames& tied,
                                     const Metadata* for_load) {
  // The boxes below place each expert by the mesh's "ep" and "tp": an MoE
  // split over other groups would be saved under the wrong boxes. Agreed
  // when the caller asked (agree_moe_groups), so that here it throws on
  // every rank or none; loading folds it into the agreement below, and a
  // rebuild's error is agreed by the save that asked for it.
  std::string error = moe_groups_error(stage, mesh);
  const ErrorKind kind = error.empty() ? ErrorKind::Checkpoint : ErrorKind::InvalidArgument;
  if (!error.empty() && !for_load) throw InvalidArgument(error);
  auto dims = tensor_parallel::split_dims(stage);
  // Experts split over tp (F / tp of each) are TP-split tensors too.
  for (const auto& e : expert_parallel::expert_tensor_split_dims(stage)) dims.insert(e);
  std::set<const void*> experts;
  for (const auto& t : expert_parallel::expert_parameters(stage)) {
    experts.insert(t.unsafeGetTensorImpl());
  }
  // A pipeline's mesh may have no "tp": its stages' tensors are whole.
  const int tp = size_or_one(mesh, "tp"), tp_rank = tp > 1 ? mesh.local_rank("tp") : 0;
  const int ep = size_or_one(mesh, "ep"), ep_rank = ep > 1 ? mesh.local_rank("ep") : 0;
  const Writers writers(mesh);
  StateDict state;
  std::vector<ParamSlot> slots;
  int64_t i = 0;  // the same tensor index on every rank of the stage
  for (const auto& p : stage.named_parameters()) {
    const auto tie = tied.find(p.key());
    const bool copy = tie != tied.end();
    const auto& name = copy ? tie->second : p.key();
    const auto it = dims.find(p.value().unsafeGetTensorImpl());
    const int64_t dim = it == dims.end() || tp == 1 ? -1 : it->second;
    // An expert parameter [E / ep, ...] is a box of the global [E, ...].
    const bool expert = ep > 1 && experts.count(p.value().unsafeGetTensorImpl()) > 0;
    const bool mine = writers.writes(i++, dim >= 0, expert) && !copy;
    if (for_load && dim >= 0 && error.empty()) {
      error = layout_error(*for_load, "model." + name, dim, tp, mesh.rank());
    }
    if (for_load && expert && error.empty()) {
      error = layout_error(*for_load, "model." + name, 0, ep, mesh.rank(), "expert-parallel");
    }
    auto shape = p.value().sizes().vec();
    Box box = whole(shape);
    if (dim >= 0) {
      shape[dim] *= tp;
      box.offsets[dim] = tp_rank * box.lengths[dim];
    }
    if (expert) {
      shape[0] *= ep;
      box.offsets[0] = ep_rank * box.lengths[0];
    }
    state.tensors.push_back(
        {"model." + name, shape, p.value().scalar_type(), false, {{box, p.value()}}, mine});
    const bool owns_step = (dim < 0 || tp_rank == 0) && (!expert || ep_rank == 0);
    slots.push_back({name, shape, p.value(), {box}, {0}, false, owns_step, mine});
  }
  for (const auto& b : stage.named_buffers()) {
    state.tensors.push_back({"model." + b.key(),
                             b.value().sizes().vec(),
                             b.value().scalar_type(),
                             false,
                             {{whole(b.value().sizes().vec()), b.value()}},
                             writers.writes(i++, false, false)});
  }
  for (const auto& m : stage.named_modules("", /*include_self=*/false)) {
    state.modules.push_back("model." + m.key());
  }
  if (for_load) agree(*mesh.process_group(), error, kind);
  if (optimizer) add_optimizer_state(state, *optimizer, slots, for_load);
  set_rebuilds(state, for_load, [&stage, &mesh, optimizer, tied](const Metadata* meta) {
    return tensor_parallel_state_dict(stage, mesh, optimizer, tied, meta);
  });
  return state;
}

}  // namespace cohort::dcp::detail
