// checkpoint as an autograd node of its own. LibTorch 1.13's saved-tensor
// default hooks take Python objects, so the C++ route is a node whose inputs
// are the function's inputs and the parameters it reads: their gradients then
// leave it along the ordinary edges, into the parameters' accumulators, where
// DDP's, ZeRO's and the fused optimizer's hooks sit.
//
// Each call of the node recomputes. The zero-bubble pipeline calls it twice
// per micro-batch: once for the input gradient (I), once for the weights (W),
// each time asking only for its part (task_should_compute_output). Keeping
// the recomputed graph from I until W would hold a block's full activations
// across the schedule's delay between them, for every micro-batch in
// flight, which is what checkpointing exists to avoid; so W recomputes
// again, from the same saved RNG state, and I and W each differentiate only
// what they need.
#include "cohort/activation/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <mutex>
#include <optional>
#include <unordered_set>

#include "cohort/core/error.h"
#include "cohort/core/once_differentiable.h"
#include "cohort/core/torch_compat.h"

namespace cohort {
namespace {

using Tensors = std::vector<torch::Tensor>;
using torch::autograd::variable_list;

[[noreturn]] void fail(const std::string& what) { throw InvalidArgument("checkpoint: " + what); }

bool differentiable(const torch::Tensor& t) {
  return t.defined() && (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()));
}

// The generators a function may draw from: the default CPU one, the
// default CUDA one of each device among the inputs (as PyTorch's
// checkpoint), and the caller's own.
class RngStates {
 public:
  static RngStates capture(const Tensors& inputs, const std::vector<at::Generator>& own) {
    RngStates s;
    s.add_once(at::detail::getDefaultCPUGenerator());
    for (const auto& t : inputs) {
      if (t.defined() && t.is_cuda()) s.add_once(at::globalContext().defaultGenerator(t.device()));
    }
    for (const auto& gen : own) {
      if (!gen.defined()) fail("an undefined generator in options.generators");
      s.add_once(gen);
    }
    return s;
  }
  // The same generators' states now.
  RngStates current() const {
    RngStates s;
    for (const auto& entry : states_) s.add(entry.first);
    return s;
  }
  void restore() const {
    for (auto [gen, state] : states_) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }

 private:
  void add(at::Generator gen) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    states_.emplace_back(gen, gen.get_state());
  }
  void add_once(const at::Generator& gen) {
    for (const auto& entry : states_) {
      if (entry.first == gen) return;
    }
    add(gen);
  }
  std::vector<std::pair<at::Generator, torch::Tensor>> states_;
};

// Runs the recompute from the forward's RNG states and gives the caller's
// stream back afterwards, also when the function throws.
class RngFork {
 public:
  explicit RngFork(const RngStates& saved) : caller_(saved.current()) { saved.restore(); }
  ~RngFork() { caller_.restore(); }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  RngStates caller_;
};

// Autocast as the forward ran under (on or off, and the dtype, for CPU and
// CUDA), entered again for the recompute: backward usually runs outside the
// caller's autocast, and a recompute that casts otherwise differentiates
// another function. The cast cache stays off while fn runs, at the forward
// and the recompute: the forward runs under no grad, and a weight's cast
// cached there, without history, would serve the caller's later uses of the
// weight in the same autocast region and the recompute, whose gradients
// would then not reach it.
class AutocastState {
 public:
  static AutocastState current() {
    AutocastState s;
    for (size_t i = 0; i < kDevices.size(); ++i)
      s.on_[i] = autocast_enabled(kDevices[i]), s.dtype_[i] = autocast_dtype(kDevices[i]);
    s.cache_ = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  void apply() const {
    for (size_t i = 0; i < kDevices.size(); ++i)
      set_autocast_enabled(kDevices[i], on_[i]), set_autocast_dtype(kDevices[i], dtype_[i]);
    at::autocast::set_autocast_cache_enabled(cache_);
  }
  AutocastState without_cache() const {
    AutocastState s = *this;
    s.cache_ = false;
    return s;
  }

 private:
  static constexpr std::array<c10::DeviceType, 2> kDevices{c10::kCPU, c10::kCUDA};
  std::array<bool, 2> on_{};
  std::array<at::ScalarType, 2> dtype_{};
  bool cache_ = true;
};

// Runs fn under `state` (without the cast cache) and gives the caller's
// back afterwards, also when fn throws.
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& state) : caller_(AutocastState::current()) {
    state.without_cache().apply();
  }
  ~AutocastScope() { caller_.apply(); }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastState caller_;
};

// The buffers a recompute may update in place (BatchNorm's running
// statistics, num_batches_tracked), copied before it and written back once
// its gradients are taken: written back earlier, the recompute's graph,
// which saves the running statistics, would see them changed. Taken at the
// recompute, not at the forward, so that updates by the forwards of other
// micro-batches in between stay. The copy bypasses the version counter (as
// BatchNorm's own update does in LibTorch 1.13): the values are what they
// were before the recompute, so a graph that saved them before is still
// right.
class BufferFork {
 public:
  explicit BufferFork(const Tensors& buffers) {
    for (const auto& b : buffers)
      if (b.defined()) saved_.emplace_back(b, b.detach().clone());
  }
  // Writes the copies back; errors reach the caller.
  void restore() {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (auto& [buffer, copy] : saved_) buffer.copy_(copy);
    saved_.clear();
  }
  // On an exception from the recompute: the buffers back too, but a second
  // exception must not escape a destructor.
  ~BufferFork() {
    try {
      restore();
    } catch (...) {
    }
  }
  BufferFork(const BufferFork&) = delete;
  BufferFork& operator=(const BufferFork&) = delete;

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> saved_;
};

// What the forward returned, to hold the recompute to it.
struct OutputMeta {
  bool defined = false;
  bool differentiable = false;
  bool adopted = false;  // the node's: not a view of an input
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes;
};

// Where an output lies in its storage, in elements.
struct Placement {
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
};

// One input slot of the node: one output, or outputs that share memory (a
// tensor and a view of it, the same tensor twice), adopted as views of one
// base over the elements [lo, hi) of their storage, as they were views of
// one tensor in fn. Then autograd sees a change in place of one of them in
// the others, as without checkpoint.
struct Slot {
  std::vector<size_t> outputs;
  std::vector<Placement> places;  // of each output; empty for a slot of one
  int64_t lo = 0, hi = 0;
};

bool has_memory(const torch::Tensor& t) {
  return t.layout() == torch::kStrided && t.has_storage() && t.numel() > 0;
}

bool same_memory(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() && has_memory(a) && has_memory(b) &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
}

// An output that shares memory with an input or a parameter is a view of it
// (fn does not change its inputs, which checkpoint checks): returned as that
// view, its gradient flows to the input directly and a change in place
// changes the input, as without checkpoint.
torch::Tensor view_of_source(const torch::Tensor& source, const torch::Tensor& out, size_t i) {
  if (source.scalar_type() != out.scalar_type())
    fail("output " + std::to_string(i) + " (" + std::string(c10::toString(out.scalar_type())) +
         ") shares memory with an input or parameter of dtype " +
         c10::toString(source.scalar_type()) + "; return a copy");
  return source.as_strided(out.sizes(), out.strides(), out.storage_offset());
}

// The outputs of a shared slot made views of one base, whose history is the
// node's.
void adopt_shared(Tensors& out, Slot& slot, const NodePtr& self) {
  const torch::Tensor first = out[slot.outputs[0]];
  slot.lo = first.storage_offset(), slot.hi = slot.lo;
  for (size_t i : slot.outputs) {
    const auto& o = out[i];
    if (o.scalar_type() != first.scalar_type())
      fail("outputs " + std::to_string(slot.outputs[0]) + " and " + std::to_string(i) +
           " share memory but are " + c10::toString(first.scalar_type()) + " and " +
           c10::toString(o.scalar_type()) + "; return a copy of one");
    int64_t end = o.storage_offset() + 1;
    for (int64_t d = 0; d < o.dim(); ++d) end += (o.size(d) - 1) * o.stride(d);
    slot.lo = std::min(slot.lo, o.storage_offset()), slot.hi = std::max(slot.hi, end);
    slot.places.push_back({o.sizes().vec(), o.strides().vec(), o.storage_offset()});
  }
  auto base =
      torch::empty({0}, first.options()).set_(first.storage(), slot.lo, {slot.hi - slot.lo}, {1});
  torch::autograd::set_history(base, self);
  for (size_t k = 0; k < slot.outputs.size(); ++k) {
    const Placement& p = slot.places[k];
    out[slot.outputs[k]] = base.as_strided(p.sizes, p.strides, p.offset);
  }
}

// The gradients of a shared slot's recomputed outputs, from its base's:
// each element of the base goes to the first position, of the first output,
// that holds it, and the others get zero. An element two outputs share then
// counts once, through the recomputed outputs, which share it as the
// forward's did.
Tensors split_gradient(const Slot& slot, const torch::Tensor& base_grad) {
  const auto g = base_grad.contiguous();
  const auto index_options = g.options().dtype(torch::kLong);
  const auto element = torch::arange(slot.hi - slot.lo, index_options);
  Tensors held;  // the base element at each position of each output
  for (const Placement& p : slot.places)
    held.push_back(element.as_strided(p.sizes, p.strides, p.offset - slot.lo).reshape({-1}));
  // A stable sort puts each element's first position first among its own.
  const auto [sorted, order] = torch::cat(held).sort(/*stable=*/true, 0, /*descending=*/false);
  auto first = torch::ones(sorted.sizes(), g.options().dtype(torch::kBool));
  if (sorted.numel() > 1) first.narrow(0, 1, sorted.numel() - 1).copy_(sorted.diff() != 0);
  const auto owns = torch::zeros_like(first).scatter_(0, order, first);
  Tensors grads;
  int64_t at = 0;
  for (const Placement& p : slot.places) {
    auto part = g.as_strided(p.sizes, p.strides, g.storage_offset() + p.offset - slot.lo);
    auto own = owns.narrow(0, at, part.numel()).reshape(p.sizes);
    at += part.numel();
    grads.push_back(torch::where(own, part, torch::zeros({}, g.options())));
  }
  return grads;
}

std::string describe(const OutputMeta& m) {
  if (!m.defined) return "undefined";
  return std::string(c10::toString(m.dtype)) + " " + c10::str(c10::IntArrayRef(m.sizes));
}

// Leaves of the recomputed graph that require grad but are neither inputs
// nor parameters: autograd::grad would never be asked for them, so their
// gradient would vanish without a word.
void check_leaves(const Tensors& roots, const Tensors& allowed_leaves) {
  std::unordered_set<const c10::TensorImpl*> allowed;
  for (const auto& t : allowed_leaves)
    if (t.defined()) allowed.insert(t.unsafeGetTensorImpl());
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& r : roots) {
    auto* fn = torch::autograd::impl::gradient_edge(r).function.get();
    if (fn && seen.insert(fn).second) stack.push_back(fn);
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      if (!allowed.count(acc->variable.unsafeGetTensorImpl()))
        fail("the function reads a tensor that requires grad (" +
             std::string(c10::toString(acc->variable.scalar_type())) + " " +
             c10::str(acc->variable.sizes()) +
             ") but is neither an input nor in params, so its gradient would be lost: pass it "
             "in params");
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      auto* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
}

class CheckpointNode : public torch::autograd::Node {
 public:
  CheckpointNode(CheckpointFunction fn, const Tensors& inputs, const Tensors& params,
                 std::optional<RngStates> rng, Tensors buffers, AutocastState autocast)
      : fn_(std::move(fn)),
        n_inputs_(inputs.size()),
        rng_(std::move(rng)),
        autocast_(autocast),
        buffers_(std::move(buffers)) {
    for (const auto& t : inputs) saved_.emplace_back(t, /*is_output=*/false);
    for (const auto& t : params) saved_.emplace_back(t, /*is_output=*/false);
  }

  std::string name() const override { return "cohort::CheckpointBackward"; }

  // The forward's outputs, made this node's: `out` is what fn returned,
  // `sources` its inputs and parameters.
  Tensors adopt_outputs(Tensors out, const NodePtr& self, const Tensors& sources) {
    bool any = false;
    for (size_t i = 0; i < out.size(); ++i) {
      const auto& o = out[i];
      OutputMeta m;
      m.defined = o.defined();
      m.differentiable = differentiable(o);
      if (m.defined) m.dtype = o.scalar_type(), m.sizes = o.sizes().vec();
      any = any || m.differentiable;
      outputs_.push_back(std::move(m));
    }
    if (!any)
      fail("the function returned no floating-point tensor, so no gradient can flow through it");
    for (size_t i = 0; i < out.size(); ++i) {
      if (!outputs_[i].differentiable) continue;
      auto source = std::find_if(sources.begin(), sources.end(),
                                 [&](const torch::Tensor& s) { return same_memory(s, out[i]); });
      if (source != sources.end()) {
        out[i] = view_of_source(*source, out[i], i);
        continue;
      }
      outputs_[i].adopted = true;
      auto shared = std::find_if(slots_.begin(), slots_.end(), [&](const Slot& slot) {
        return same_memory(out[slot.outputs[0]], out[i]);
      });
      if (shared == slots_.end()) shared = slots_.insert(slots_.end(), Slot());
      shared->outputs.push_back(i);
    }
    for (auto& slot : slots_) {
      if (slot.outputs.size() > 1) {
        adopt_shared(out, slot, self);
      } else {
        // detach: an output that is a view of a tensor fn made becomes a
        // tensor of its own, whose history is the node's.
        auto& o = out[slot.outputs[0]];
        o = o.detach();
        torch::autograd::set_history(o, self);
      }
    }
    return out;
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_)
      fail(
          "backward through the same checkpointed call a second time; the first backward "
          "freed its inputs (pass retain_graph=true to it)");
    variable_list result(saved_.size());
    std::vector<size_t> wanted;
    for (size_t i = 0; i < saved_.size(); ++i)
      if (task_should_compute_output(i)) wanted.push_back(i);
    if (wanted.empty()) return result;
    Tensors inputs(n_inputs_), params;
    for (size_t i = 0; i < saved_.size(); ++i) {
      auto t = saved_[i].unpack();
      if (i >= n_inputs_) {
        params.push_back(t);
      } else if (t.defined()) {
        // A leaf of the recompute's own, requiring grad only where this
        // backward needs it, so the recompute builds only that graph.
        bool want = std::find(wanted.begin(), wanted.end(), i) != wanted.end();
        inputs[i] = t.detach().requires_grad_(want);
      }
    }
    BufferFork buffers(buffers_);
    Tensors out = recompute(inputs);
    Tensors roots, root_grads;
    for (size_t s = 0; s < slots_.size(); ++s) {
      if (!grads[s].defined()) continue;
      const Slot& slot = slots_[s];
      Tensors g = slot.places.empty() ? Tensors{grads[s]} : split_gradient(slot, grads[s]);
      for (size_t k = 0; k < slot.outputs.size(); ++k) {
        const auto& o = out[slot.outputs[k]];
        if (o.requires_grad()) roots.push_back(o), root_grads.push_back(g[k]);
      }
    }
    if (roots.empty()) {  // no gradient reached an output that has a graph
      buffers.restore();
      return result;
    }
    Tensors leaves = inputs, wrt;
    leaves.insert(leaves.end(), params.begin(), params.end());
    check_leaves(roots, leaves);
    for (size_t i : wanted) wrt.push_back(leaves[i]);
    auto got = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                     /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t j = 0; j < wanted.size(); ++j) result[wanted[j]] = got[j];
    buffers.restore();
    // The recompute's graph starts at detached copies of the inputs.
    return once_differentiable(std::move(result), "checkpoint");
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu_);
    saved_.clear();
    buffers_.clear();
    fn_ = nullptr;
    released_ = true;
  }

 private:
  // fn again, with grad and from the forward's RNG state; its outputs must
  // match the forward's.
  Tensors recompute(const Tensors& inputs) {
    Tensors out;
    {
      std::optional<RngFork> fork;
      if (rng_) fork.emplace(*rng_);
      AutocastScope autocast(autocast_);
      torch::AutoGradMode grad(true);
      out = fn_(inputs);
    }
    if (out.size() != outputs_.size())
      fail("the recomputed function returned " + std::to_string(out.size()) +
           " tensors, the forward " + std::to_string(outputs_.size()) +
           ": it must be deterministic");
    bool any_graph = false;
    for (size_t i = 0; i < out.size(); ++i) {
      const OutputMeta& m = outputs_[i];
      const bool same =
          out[i].defined() == m.defined &&
          (!m.defined || (out[i].scalar_type() == m.dtype && out[i].sizes() == m.sizes));
      if (!same)
        fail("the recomputed function's output " + std::to_string(i) + " is " +
             (out[i].defined() ? std::string(c10::toString(out[i].scalar_type())) + " " +
                                     c10::str(out[i].sizes())
                               : "undefined") +
             ", the forward's was " + describe(m) + ": it must be deterministic");
      any_graph = any_graph || (m.adopted && out[i].requires_grad());
    }
    if (!any_graph)
      fail(
          "the recomputed function returned no tensor that requires grad, though backward needs "
          "gradients for its inputs or parameters (does it detach them, or run under "
          "NoGradGuard?)");
    return out;
  }

  std::mutex mu_;
  CheckpointFunction fn_;
  std::vector<torch::autograd::SavedVariable> saved_;  // inputs, then params
  size_t n_inputs_;
  std::optional<RngStates> rng_;
  AutocastState autocast_;  // the forward's
  Tensors buffers_;         // written back after each recompute
  std::vector<OutputMeta> outputs_;
  std::vector<Slot> slots_;  // the node's inputs, in order
  bool released_ = false;
};

std::vector<int64_t> versions_of(const Tensors& tensors) {
  std::vector<int64_t> v;
  for (const auto& t : tensors) v.push_back(t.defined() ? t._version() : 0);
  return v;
}

// fn must not change its inputs or parameters: the recompute would start
// from the changed values, and an output that is a view of one is returned
// as that view, unchanged by fn.
void check_unchanged(const Tensors& sources, const std::vector<int64_t>& versions) {
  for (size_t i = 0; i < sources.size(); ++i)
    if (sources[i].defined() && sources[i]._version() != versions[i])
      fail("the function changed its input or parameter " + std::to_string(i) +
           " (inputs first, then the parameters requiring grad) in place");
}

}  // namespace

Tensors checkpoint(CheckpointFunction fn, const Tensors& inputs, const Tensors& params,
                   CheckpointOptions options) {
  if (!fn) fail("no function to run");
  Tensors trainable;
  for (const auto& p : params)
    if (p.defined() && p.requires_grad()) trainable.push_back(p);
  bool needs_graph = false;
  for (const auto& t : inputs) needs_graph = needs_graph || (t.defined() && t.requires_grad());
  needs_graph = torch::GradMode::is_enabled() && (needs_graph || !trainable.empty());
  if (!needs_graph) return fn(inputs);

  std::optional<RngStates> rng;
  if (options.preserve_rng_state) rng = RngStates::capture(inputs, options.generators);
  const auto autocast = AutocastState::current();
  auto node =
      make_node<CheckpointNode>(fn, inputs, trainable, std::move(rng), options.buffers, autocast);
  Tensors edges = inputs;
  edges.insert(edges.end(), trainable.begin(), trainable.end());
  node->set_next_edges(torch::autograd::collect_next_edges(edges));
  Tensors out;
  {
    torch::NoGradGuard no_grad;
    AutocastScope no_cache(autocast);
    const auto versions = versions_of(edges);
    out = fn(inputs);
    check_unchanged(edges, versions);
  }
  return node->adopt_outputs(std::move(out), node, edges);
}

torch::Tensor checkpoint(std::function<torch::Tensor(const torch::Tensor&)> fn,
                         const torch::Tensor& input, const Tensors& params,
                         CheckpointOptions options) {
  if (!fn) fail("no function to run");
  auto wrapped = [fn = std::move(fn)](const Tensors& in) { return Tensors{fn(in[0])}; };
  return checkpoint(wrapped, Tensors{input}, params, options)[0];
}

}  // namespace cohort
