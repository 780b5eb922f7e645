#include "cohort/fsdp/fully_shard.h"

#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "cohort/core/error.h"

namespace cohort {
namespace {

// Modules wrapped by a live FullyShard: wrapping one twice is an error.
std::mutex wrapped_mutex;
std::set<const torch::nn::Module*> wrapped;

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

}  // namespace

FullyShardImpl::FullyShardImpl(torch::nn::AnyModule module, std::shared_ptr<Communicator> comm,
                               FullyShardOptions options)
    : options_(options) {
  if (module.is_empty()) throw InvalidArgument("fully_shard: no module to wrap");
  call_ = [module](const torch::Tensor& x) mutable { return module.forward<torch::Tensor>(x); };
  adopt(module.ptr(), std::move(comm));
}

FullyShardImpl::FullyShardImpl(torch::nn::Sequential module, std::shared_ptr<Communicator> comm,
                               FullyShardOptions options)
    : options_(options) {
  if (module.is_empty()) throw InvalidArgument("fully_shard: no module to wrap");
  call_ = [module](const torch::Tensor& x) mutable { return module->forward(x); };
  adopt(module.ptr(), std::move(comm));
}

FullyShardImpl::~FullyShardImpl() {
  std::lock_guard<std::mutex> lock(wrapped_mutex);
  wrapped.erase(inner_.get());
}

void FullyShardImpl::adopt(const std::shared_ptr<torch::nn::Module>& inner,
                           std::shared_ptr<Communicator> comm) {
  if (!comm) throw InvalidArgument("fully_shard: no communicator");
  const std::string where = "fully_shard(" + inner->name() + ")" + rank_of(*comm);
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
  comm_ = std::move(comm);
  // The inner module's own names, so names match the bare model's.
  for (const auto& child : inner->named_children()) register_module(child.key(), child.value());
  for (const auto& p : inner->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().requires_grad());
  }
  for (const auto& b : inner->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());

  // Parameters an inner unit holds, and the unit's path.
  std::map<const void*, std::string> held;
  for (const auto& m : inner->named_modules("", /*include_self=*/false)) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.value().get());
    if (!unit || !unit->group_) continue;
    for (const auto& p : unit->group_->params()) held[p.unsafeGetTensorImpl()] = m.key();
  }
  std::vector<torch::Tensor> own;
  std::vector<std::string> names;
  std::set<const void*> seen;
  for (const auto& p : inner->named_parameters()) {
    const void* impl = p.value().unsafeGetTensorImpl();
    auto it = held.find(impl);
    if (it != held.end()) {
      if (p.key().rfind(it->second + ".", 0) != 0) {
        throw InvalidArgument(where + ": parameter '" + p.key() + "' is also held by the unit '" +
                              it->second +
                              "'; a parameter shared by two units must belong to a unit that "
                              "holds both (wrap only their common parent)");
      }
      continue;
    }
    if (!seen.insert(impl).second) continue;  // tied within this unit: held once
    own.push_back(p.value());
    names.push_back(p.key());
  }
  fsdp::verify_same_policy(*comm_, options_.mp_policy, "fully_shard(" + inner->name() + ")");
  if (!own.empty()) {
    group_ = std::make_unique<fsdp::FSDPParamGroup>(std::move(own), std::move(names), comm_,
                                                    inner->name(), options_.mp_policy);
  }
  forget.armed = false;
}

std::shared_ptr<fsdp::FSDPState> FullyShardImpl::root_state() {
  if (state_) return state_;
  std::vector<FullyShardImpl*> units;
  if (group_) units.push_back(this);
  std::set<const FullyShardImpl*> listed{this};
  for (const auto& m : named_modules("", /*include_self=*/false)) {
    auto* unit = dynamic_cast<FullyShardImpl*>(m.value().get());
    if (!unit || !listed.insert(unit).second) continue;
    if (unit->state_) {
      throw InvalidArgument("fully_shard" + rank_of(*comm_) + ": the unit '" + m.key() +
                            "' already ran as a root of its own; run the outer model from its "
                            "first forward on");
    }
    if (unit->group_) units.push_back(unit);
  }
  std::vector<fsdp::UnitEntry> entries;
  for (auto* unit : units)
    entries.push_back({unit->group_.get(), &unit->options_.reshard_after_forward});
  std::vector<torch::Tensor> buffers;
  for (const auto& b : this->buffers()) buffers.push_back(b);
  state_ = std::make_shared<fsdp::FSDPState>(std::move(entries), group_ != nullptr,
                                             std::move(buffers), comm_);
  for (size_t u = 0; u < units.size(); ++u) {
    units[u]->outer_ = state_;
    units[u]->index_ = u;
  }
  if (!group_) index_ = fsdp::FSDPState::kRoot;
  return state_;
}

torch::Tensor FullyShardImpl::forward(const torch::Tensor& input) {
  const auto& mp = options_.mp_policy;
  const auto x = cast_to(input, mp.cast_forward_inputs ? mp.param_dtype : std::nullopt);
  std::shared_ptr<fsdp::FSDPState> state;
  if (forward_depth == 0) {
    state = root_state();
  } else if (!group_) {
    DepthGuard depth;
    return cast_to(call_(x), mp.output_dtype);  // nothing of its own to gather
  } else {
    state = outer_.lock();
    if (!state) {
      throw InvalidArgument("fully_shard(" + inner_->name() + ")" + rank_of(*comm_) +
                            ": this unit runs inside a module that is not a FullyShard root; "
                            "wrap the whole model with fully_shard");
    }
  }
  state->pre_forward(index_, is_training());
  torch::Tensor out;
  {
    DepthGuard depth;
    out = call_(x);
  }
  state->post_forward(index_, out);
  return cast_to(out, mp.output_dtype);
}

void FullyShardImpl::train(bool on) {
  torch::nn::Module::train(on);
  inner_->train(on);
}

void FullyShardImpl::unshard() { root_state()->unshard_all(); }

void FullyShardImpl::reshard() { root_state()->reshard_all(); }

void FullyShardImpl::set_requires_gradient_sync(bool sync) {
  root_state()->set_requires_gradient_sync(sync);
}

torch::OrderedDict<std::string, torch::Tensor> FullyShardImpl::full_state_dict() {
  auto state = root_state();
  std::map<const void*, torch::Tensor> full;
  torch::NoGradGuard no_grad;
  // Gathered from the shards: their dtype (the master weights under mixed
  // precision), whether or not the units are unsharded now.
  for (const auto& unit : state->units()) {
    auto values = unit.group->gather_full();
    for (size_t i = 0; i < values.size(); ++i) {
      full[unit.group->params()[i].unsafeGetTensorImpl()] = std::move(values[i]);
    }
  }
  torch::OrderedDict<std::string, torch::Tensor> out;
  for (const auto& p : named_parameters()) {
    out.insert(p.key(), full.at(p.value().unsafeGetTensorImpl()));
  }
  for (const auto& b : named_buffers()) out.insert(b.key(), b.value().clone());
  return out;
}

void FullyShardImpl::load_full_state_dict(
    const torch::OrderedDict<std::string, torch::Tensor>& state_dict) {
  auto state = root_state();
  std::map<const void*, std::string> name_of;
  for (const auto& p : named_parameters())
    name_of.emplace(p.value().unsafeGetTensorImpl(), p.key());
  auto lookup = [&](const std::string& name, c10::IntArrayRef sizes) {
    const auto* t = state_dict.find(name);
    if (!t) {
      throw InvalidArgument("load_full_state_dict" + rank_of(*comm_) + ": '" + name +
                            "' is missing from the state dict");
    }
    if (t->sizes() != sizes) {
      throw InvalidArgument("load_full_state_dict" + rank_of(*comm_) + ": '" + name + "' is " +
                            c10::str(t->sizes()) + " in the state dict, " + c10::str(sizes) +
                            " in the model");
    }
    return *t;
  };
  // Every key is checked before anything is copied.
  std::vector<std::vector<torch::Tensor>> per_unit;
  for (const auto& unit : state->units()) {
    std::vector<torch::Tensor> full;
    const auto& layout = unit.group->layout();
    for (size_t i = 0; i < unit.group->params().size(); ++i) {
      full.push_back(lookup(name_of.at(unit.group->params()[i].unsafeGetTensorImpl()),
                            layout.params[i].full_sizes));
    }
    per_unit.push_back(std::move(full));
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> buffers;
  for (const auto& b : named_buffers())
    buffers.emplace_back(b.value(), lookup(b.key(), b.value().sizes()));
  state->reshard_all();
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < per_unit.size(); ++u) state->units()[u].group->load_full(per_unit[u]);
  for (auto& [mine, theirs] : buffers) mine.copy_(theirs);
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
  torch::nn::Sequential out;
  for (const auto& layer : *model) {
    if (layer.ptr()->parameters().empty()) {
      out->push_back(layer);
    } else {
      out->push_back(FullyShard(layer, comm, options));
    }
  }
  return out;
}

}  // namespace cohort
