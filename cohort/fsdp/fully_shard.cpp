#include "cohort/fsdp/fully_shard.h"

#include <cmath>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/core/rank_local.h"
#include "cohort/fsdp/unit_agreement.h"
#include "cohort/grad_sync/parameter_check.h"

namespace cohort {
namespace {

// Modules wrapped by a live FullyShard: wrapping one twice is an error.
std::mutex wrapped_mutex;
std::set<const torch::nn::Module*> wrapped;
// Parameters held by live units, and a description of the unit: a parameter
// tied across two units that do not nest is refused before the second one
// would shard it again.
std::map<const void*, std::string> held_by;

std::string held_elsewhere(const void* impl, const std::string& name) {
  std::lock_guard<std::mutex> lock(wrapped_mutex);
  auto it = held_by.find(impl);
  if (it == held_by.end()) return "";
  return "parameter '" + name + "' is also held by another unit (" + it->second +
         "), which already sharded it; a parameter shared by two units must belong to a unit "
         "that holds both (wrap only their common parent)";
}

// Forwards of FullyShard units running on this thread: the outermost one
// (depth 0) is the root.
thread_local int forward_depth = 0;

struct DepthGuard {
  DepthGuard() { ++forward_depth; }
  ~DepthGuard() { --forward_depth; }
};

std::string rank_of(const Communicator& comm) { return " on rank " + std::to_string(comm.rank()); }

// `x` in `dtype` if both are floating (a differentiable cast).
torch::Tensor cast_to(const torch::Tensor& x, std::optional<torch::Dtype> dtype) {
  if (!dtype || !x.defined() || !x.is_floating_point() || x.scalar_type() == *dtype) return x;
  return x.to(*dtype);
}

// The 1-D mesh of `comm` (the Communicator overloads).
DeviceMesh mesh_of(std::shared_ptr<Communicator> comm, const std::string& who) {
  if (!comm) throw InvalidArgument(who + ": no communicator");
  return DeviceMesh::from_group(std::move(comm), "shard");
}

struct MeshGroups {
  std::shared_ptr<Communicator> shard, replicate;
};

// The shard group and (HSDP) the replicate group of `mesh`. The mesh's
// shape is the same on every rank (init_device_mesh agreed on it), so a
// refusal is one on every rank.
MeshGroups groups_of(const DeviceMesh& mesh, const std::string& who) {
  if (mesh.ndim() == 1) return {mesh.process_group(), nullptr};
  if (mesh.ndim() == 2) {
    auto names = mesh.dim_names();
    // By name when so named, else by position, as FSDP2: (replicate, shard).
    if (names[0] == "shard" && names[1] == "replicate") std::swap(names[0], names[1]);
    return {mesh[names[1]].process_group(), mesh[names[0]].process_group()};
  }
  throw InvalidArgument(who + rank_of(*mesh.process_group()) +
                        ": needs a mesh of 1 dimension (FSDP) or 2 (HSDP: replicate, shard), "
                        "got " +
                        std::to_string(mesh.ndim()) + " (" + mesh.to_string() + ")");
}

}  // namespace

FullyShardImpl::FullyShardImpl(torch::nn::AnyModule module, const DeviceMesh& mesh,
                               FullyShardOptions options)
    : options_(options) {
  if (module.is_empty()) throw InvalidArgument("fully_shard: no module to wrap");
  call_ = [module](const torch::Tensor& x) mutable { return module.forward<torch::Tensor>(x); };
  adopt(module.ptr(), mesh);
}

FullyShardImpl::FullyShardImpl(torch::nn::Sequential module, const DeviceMesh& mesh,
                               FullyShardOptions options)
    : options_(options) {
  if (module.is_empty()) throw InvalidArgument("fully_shard: no module to wrap");
  call_ = [module](const torch::Tensor& x) mutable { return module->forward(x); };
  adopt(module.ptr(), mesh);
}

FullyShardImpl::FullyShardImpl(torch::nn::AnyModule module, std::shared_ptr<Communicator> comm,
                               FullyShardOptions options)
    : FullyShardImpl(std::move(module), mesh_of(std::move(comm), "fully_shard"), options) {}

FullyShardImpl::FullyShardImpl(torch::nn::Sequential module, std::shared_ptr<Communicator> comm,
                               FullyShardOptions options)
    : FullyShardImpl(std::move(module), mesh_of(std::move(comm), "fully_shard"), options) {}

FullyShardImpl::~FullyShardImpl() {
  // The units inside it stay alive while it is (it holds them).
  for (const auto& m : inner_->modules()) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.get());
    if (unit && unit->enclosing_ == this) unit->enclosing_ = nullptr;
  }
  std::lock_guard<std::mutex> lock(wrapped_mutex);
  wrapped.erase(inner_.get());
  for (const void* impl : holding_) held_by.erase(impl);
}

void FullyShardImpl::hold(const std::string& unit) {
  std::lock_guard<std::mutex> lock(wrapped_mutex);
  for (size_t i = 0; i < group_->params().size(); ++i) {
    const void* impl = group_->params()[i].unsafeGetTensorImpl();
    held_by[impl] = "the unit around " + unit + ", as its '" + group_->names()[i] + "'";
    holding_.push_back(impl);
  }
}

FullyShardImpl::OwnParameters FullyShardImpl::describe_unit(const torch::nn::Module& inner,
                                                            fsdp::UnitRecord& record) {
  // Parameters an inner unit holds, and the unit's path; the inner units'
  // digests in pre-order.
  std::vector<int64_t> inner_digests;
  std::map<const void*, std::string> held;
  for (const auto& m : inner.named_modules("", /*include_self=*/false)) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.value().get());
    if (!unit) continue;
    ++record.units;
    inner_digests.push_back(static_cast<int64_t>(unit->digest_));
    if (!unit->group_) continue;
    for (const auto& p : unit->group_->params()) held[p.unsafeGetTensorImpl()] = m.key();
  }
  record.inner = fnv1a_words(inner_digests);
  OwnParameters own;
  std::set<const void*> seen;
  std::vector<int64_t> shapes;
  for (const auto& p : inner.named_parameters()) {
    const void* impl = p.value().unsafeGetTensorImpl();
    auto it = held.find(impl);
    if (it != held.end()) {
      if (p.key().rfind(it->second + ".", 0) != 0 && record.refusal.empty()) {
        record.refusal = "parameter '" + p.key() + "' is also held by the unit '" + it->second +
                         "'; a parameter shared by two units must belong to a unit that holds "
                         "both (wrap only their common parent)";
      }
      continue;
    }
    if (!seen.insert(impl).second) continue;  // tied within this unit: held once
    if (record.refusal.empty()) record.refusal = held_elsewhere(impl, p.key());
    // Sharded as one tensor over the mesh, a rank's part of a split tensor
    // (an MoE's experts) would be replaced by rank 0's at the first gather.
    if (record.refusal.empty()) record.refusal = rank_local_refusal({p.value()}, {p.key()});
    own.params.push_back(p.value());
    own.names.push_back(p.key());
    shapes.push_back(static_cast<int64_t>(p.value().scalar_type()));
    shapes.push_back(p.value().dim());
    for (auto s : p.value().sizes()) shapes.push_back(s);
    record.numel += p.value().numel();
  }
  record.params = static_cast<int64_t>(own.params.size());
  record.shapes = fnv1a_words(shapes);
  // Sharded over ranks that hold other TP ranks' parts, a gathered parameter
  // would be pieced together from different parts.
  record.tp_parts = fnv1a_words(tensor_parallel_words(own.params));
  record.own_params = own.params;
  record.own_names = own.names;
  return own;
}

void FullyShardImpl::adopt(const std::shared_ptr<torch::nn::Module>& inner,
                           const DeviceMesh& mesh) {
  const std::string where_name = "fully_shard(" + inner->name() + ")";
  auto groups = groups_of(mesh, where_name);
  const std::string where = where_name + rank_of(*mesh.process_group());
  if (dynamic_cast<FullyShardImpl*>(inner.get())) {
    throw InvalidArgument(where + ": the module is already a FullyShard unit");
  }
  {
    std::lock_guard<std::mutex> lock(wrapped_mutex);
    if (!wrapped.insert(inner.get()).second) {
      throw InvalidArgument(where + ": fully_shard was already applied to this module");
    }
  }
  // A construction that throws (ranks that disagree) runs no destructor:
  // forget the module, or a later one at its address would be refused.
  struct Forget {
    const torch::nn::Module* module;
    bool armed = true;
    ~Forget() {
      if (!armed) return;
      std::lock_guard<std::mutex> lock(wrapped_mutex);
      wrapped.erase(module);
    }
  } forget{inner.get()};
  inner_ = inner;
  mesh_ = mesh;
  comm_ = std::move(groups.shard);
  replicate_ = std::move(groups.replicate);
  world_ = mesh.process_group();
  // The inner module's own names, so names match the bare model's.
  for (const auto& child : inner->named_children()) register_module(child.key(), child.value());
  for (const auto& p : inner->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : inner->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());

  fsdp::UnitRecord record;
  record.module = inner->name();
  record.reshard_after_forward = options_.reshard_after_forward;
  record.policy = options_.mp_policy;
  auto [own, names] = describe_unit(*inner, record);
  digest_ = record.digest();
  // Before anything is sharded or sent: every rank of the mesh wraps the
  // same unit (its replicas too).
  fsdp::agree_unit(*world_, record, where_name);
  // Agreed, so a bad value is refused on every rank.
  reshard_code_ = options_.reshard_after_forward.resolve(comm_->size(), where);
  if (!own.empty()) {
    std::shared_ptr<Communicator> post_forward;
    if (reshard_code_ >= 2) {
      // hpZ: groups of N consecutive ranks of the shard group (collective
      // over it; every rank makes it, having agreed on N above).
      post_forward = comm_->split(comm_->rank() / reshard_code_, comm_->rank() % reshard_code_);
      post_forward_size_ = reshard_code_;
    }
    group_ = std::make_unique<fsdp::FSDPParamGroup>(std::move(own), std::move(names), comm_,
                                                    inner->name(), options_.mp_policy, replicate_,
                                                    std::move(post_forward));
    hold(inner->name());
  }
  // The units inside it are no roots: their root-only methods refuse, and
  // their unshard() and reshard() act on themselves.
  for (const auto& m : inner->modules()) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.get());
    if (unit && !unit->enclosing_) unit->enclosing_ = this;
  }
  forget.armed = false;
}

void FullyShardImpl::require_root(const std::string& method) const {
  if (!enclosed()) return;
  throw InvalidArgument(method + " on the unit around " + inner_->name() + rank_of(*world_) +
                        ": this unit is inside another FullyShard, whose schedule (the root's) "
                        "runs every unit of the model; call " +
                        method + " on the root");
}

std::vector<FullyShardImpl*> FullyShardImpl::subtree_units() {
  std::vector<FullyShardImpl*> out;
  std::set<FullyShardImpl*> listed{this};
  if (group_) out.push_back(this);
  for (const auto& m : modules(/*include_self=*/false)) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.get());
    if (unit && listed.insert(unit).second && unit->group_) out.push_back(unit);
  }
  return out;
}

std::string FullyShardImpl::replaced_storage() {
  for (auto* unit : subtree_units()) {
    auto why = unit->group_->replaced_storage();
    if (!why.empty()) return why;
  }
  return "";
}

std::shared_ptr<fsdp::FSDPState> FullyShardImpl::root_state() {
  if (state_) return state_;
  std::vector<FullyShardImpl*> units;
  std::vector<std::string> paths;
  if (group_) units.push_back(this), paths.push_back("<root>");
  std::set<FullyShardImpl*> listed{this};
  for (const auto& m : named_modules("", /*include_self=*/false)) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.value().get());
    if (!unit || !listed.insert(unit).second) continue;
    if (unit->state_) {
      throw InvalidArgument("fully_shard" + rank_of(*world_) + ": the unit '" + m.key() +
                            "' already ran as a root of its own (its forward ran alone before "
                            "the model's first forward); run the outer model from its first "
                            "forward on");
    }
    if (unit->comm_ != comm_ || unit->replicate_ != replicate_) {
      throw InvalidArgument("fully_shard" + rank_of(*world_) + ": the unit '" + m.key() +
                            "' was made over another mesh than its root (" +
                            unit->mesh_->to_string() + " against " + mesh_->to_string() +
                            "); make every unit of a model over the same mesh");
    }
    if (unit->group_) units.push_back(unit), paths.push_back(m.key());
  }
  std::vector<fsdp::UnitEntry> entries;
  for (size_t u = 0; u < units.size(); ++u) {
    entries.push_back({units[u]->group_.get(), &units[u]->reshard_code_,
                       &units[u]->requires_gradient_sync_, paths[u]});
  }
  std::vector<torch::Tensor> buffers;
  for (const auto& b : this->buffers()) buffers.push_back(b);
  const bool leaves = options_.determinism == Determinism::WorldSizeInvariant;
  for (size_t u = 0; u < units.size(); ++u) {
    const auto& o = units[u]->options_;
    if (o.determinism != options_.determinism || (leaves && o.leaves != options_.leaves)) {
      throw InvalidArgument("fully_shard" + rank_of(*world_) + ": the unit '" + paths[u] +
                            "' has another determinism or leaf count than its root; give every "
                            "unit of a model the same");
    }
  }
  if (leaves && options_.leaves < 1) {
    throw InvalidArgument("fully_shard" + rank_of(*world_) +
                          ": determinism WorldSizeInvariant needs leaves >= 1, got " +
                          std::to_string(options_.leaves));
  }
  state_ =
      std::make_shared<fsdp::FSDPState>(std::move(entries), group_ != nullptr, std::move(buffers),
                                        comm_, world_, leaves ? options_.leaves : 0);
  for (auto* unit : listed) {
    if (unit != this) unit->outer_ = state_;
  }
  for (size_t u = 0; u < units.size(); ++u) units[u]->index_ = u;
  if (!group_) index_ = fsdp::FSDPState::kRoot;
  return state_;
}

torch::Tensor FullyShardImpl::forward(const torch::Tensor& input) {
  const auto& mp = options_.mp_policy;
  const auto x = cast_to(input, mp.cast_forward_inputs ? mp.param_dtype : std::nullopt);
  // A unit of a root stays one when it runs outside the root's forward (a
  // checkpointed block recomputing it in backward): never a root of its own.
  auto state = outer_.lock();
  if (!state && forward_depth == 0) state = root_state();
  if (!state || (!group_ && state != state_)) {
    if (group_) {
      throw InvalidArgument("fully_shard(" + inner_->name() + ")" + rank_of(*world_) +
                            ": this unit runs inside a module that is not a FullyShard root; "
                            "wrap the whole model with fully_shard");
    }
    DepthGuard depth;
    return cast_to(call_(x), mp.output_dtype);  // nothing of its own to gather
  }
  const bool outermost = forward_depth == 0;
  torch::Tensor out;
  try {
    const auto in = state->pre_forward(index_, is_training(), x);
    {
      DepthGuard depth;
      out = call_(in);
    }
    state->post_forward(index_, out, outermost);
  } catch (...) {
    // Units the forward gathered would stay so (their parameters are the
    // optimizer's tensors); the caller gets the exception as it was thrown.
    if (outermost) state->forward_failed();
    throw;
  }
  return cast_to(out, mp.output_dtype);
}

void FullyShardImpl::train(bool on) {
  torch::nn::Module::train(on);
  inner_->train(on);
}

void FullyShardImpl::unshard() {
  if (!enclosed()) {
    root_state()->unshard_all();
    return;
  }
  const auto units = subtree_units();
  if (auto state = outer_.lock()) {
    // Through the root's schedule, which checks that every rank unshards
    // the same units.
    std::vector<size_t> indices;
    for (auto* unit : units) indices.push_back(unit->index_);
    state->unshard_units(indices);
    return;
  }
  // Before the model's first forward: there is no schedule yet.
  fsdp::agree_refusal(*world_, replaced_storage(), "unshard(" + inner_->name() + ")");
  for (auto* unit : units) {
    unit->group_->drop_post_forward_shard();
    unit->group_->start_unshard();
  }
  for (auto* unit : units) unit->group_->wait_unshard();
}

void FullyShardImpl::reshard() {
  if (!enclosed()) {
    root_state()->reshard_all();
    return;
  }
  for (auto* unit : subtree_units()) unit->group_->reshard();
}

void FullyShardImpl::set_reshard_after_forward(ReshardAfterForward reshard) {
  const std::string who = "set_reshard_after_forward(" + inner_->name() + ")" + rank_of(*world_);
  const int code = reshard.resolve(comm_->size(), who);
  if (code >= 2 && group_ && code != post_forward_size_) {
    throw InvalidArgument(who + ": reshard_after_forward = " + reshard.to_string() +
                          " needs its group of ranks, which fully_shard makes (collectively): "
                          "pass it in FullyShardOptions");
  }
  options_.reshard_after_forward = reshard;
  reshard_code_ = code;
}

int64_t FullyShardImpl::local_leaves() const {
  if (options_.determinism != Determinism::WorldSizeInvariant) return 1;
  return options_.leaves / comm_->size();
}

double FullyShardImpl::clip_grad_norm(double max_norm) {
  require_root("clip_grad_norm");
  auto state = root_state();
  const double norm = std::sqrt(state->squared_grad_norm());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    torch::NoGradGuard no_grad;
    for (const auto& unit : state->units()) {
      for (const auto& p : unit.group->params()) {
        if (p.grad().defined()) p.grad().mul_(coef);
      }
    }
  }
  return norm;
}

void FullyShardImpl::set_requires_gradient_sync(bool sync, bool recurse) {
  if (!sync && options_.determinism == Determinism::WorldSizeInvariant) {
    throw InvalidArgument("fully_shard: set_requires_gradient_sync(false) on rank " +
                          std::to_string(world_->rank()) + " of " + std::to_string(world_->size()) +
                          " is refused with determinism WorldSizeInvariant (the leaves are the "
                          "step's accumulation; local accumulation would reorder the sums)");
  }
  // Each unit's own flag: the root's schedule reads them at each forward
  // and backward, so a unit's setting holds before the schedule exists too.
  requires_gradient_sync_ = sync;
  if (recurse) {
    for (auto* unit : subtree_units()) unit->requires_gradient_sync_ = sync;
  }
}

FullyShard fully_shard(torch::nn::AnyModule module, const DeviceMesh& mesh,
                       FullyShardOptions options) {
  return FullyShard(std::move(module), mesh, options);
}

FullyShard fully_shard(torch::nn::Sequential module, const DeviceMesh& mesh,
                       FullyShardOptions options) {
  return FullyShard(std::move(module), mesh, options);
}

FullyShard fully_shard(torch::nn::AnyModule module, std::shared_ptr<Communicator> comm,
                       FullyShardOptions options) {
  return FullyShard(std::move(module), std::move(comm), options);
}

FullyShard fully_shard(torch::nn::Sequential module, std::shared_ptr<Communicator> comm,
                       FullyShardOptions options) {
  return FullyShard(std::move(module), std::move(comm), options);
}

torch::nn::Sequential shard_blocks(const torch::nn::Sequential& model,
                                   std::shared_ptr<Communicator> comm, FullyShardOptions options) {
  if (model.is_empty()) throw InvalidArgument("shard_blocks: no model");
  return shard_blocks(model, mesh_of(std::move(comm), "shard_blocks"), options);
}

torch::nn::Sequential shard_blocks(const torch::nn::Sequential& model, const DeviceMesh& mesh,
                                   FullyShardOptions options) {
  if (model.is_empty()) throw InvalidArgument("shard_blocks: no model");
  // A parameter tied across two layers would be sharded by the first unit
  // and found sharded by the second: refused before any unit is made, on
  // every rank (the agreement below).
  fsdp::UnitRecord check;
  check.module = "shard_blocks";
  std::map<const void*, std::string> first_seen;
  size_t i = 0;
  for (const auto& layer : *model) {
    for (const auto& p : layer.ptr()->named_parameters()) {
      const std::string name = std::to_string(i) + "." + p.key();
      auto [it, fresh] = first_seen.emplace(p.value().unsafeGetTensorImpl(), name);
      if (fresh || it->second.substr(0, it->second.find('.')) == std::to_string(i)) continue;
      if (check.refusal.empty()) {
        check.refusal = "parameter '" + name + "' is the same tensor as '" + it->second +
                        "', and shard_blocks would make layers " +
                        it->second.substr(0, it->second.find('.')) + " and " + std::to_string(i) +
                        " units of their own, each sharding it; leave those layers to a unit "
                        "that holds both (the root)";
      }
    }
    ++i;
  }
  fsdp::agree_unit(*mesh.process_group(), check, "shard_blocks");
  torch::nn::Sequential out;
  for (const auto& layer : *model) {
    if (layer.ptr()->parameters().empty()) {
      out->push_back(layer);
    } else {
      out->push_back(FullyShard(layer, mesh, options));
    }
  }
  return out;
}

}  // namespace cohort
