// FSDPState: when a unit's backward is over.
//
// A layer may read a weight of the unit in backward after that weight's
// gradient landed: a frozen layer (it lands none, and reads its weight for
// the gradient of what it read), or a read of a trainable weight with no
// autograd edge to it (w.detach(), a view made under NoGradGuard), whose
// backward node saved an alias of the full parameter. The accumulator runs
// first (the engine's ready queue puts it ahead), so the unit's last
// gradient may land before such a layer's backward ran: the unit must stay
// gathered until then. What the layer read may be the unit's input, or a
// tensor the unit's module got another way (a member, a closure: a decoder
// block's encoder output). So each call's autograd nodes are found when its
// forward returns: those made on the forward's thread since it began
// (sequence numbers are per thread and increase) and reachable from its
// output. A node with an edge out of the call, to a node that is not the
// accumulator of a parameter of the unit or of a unit inside it, gets a
// post hook; so does a node with no edge. Every node of the call has a path
// to such a node or to such an accumulator, and the engine runs a node only
// after every node with an edge to it: once the hooked nodes have run, the
// unit's gradients have landed and the units inside it are over, none of
// the call's nodes is left to run. This is FSDP2's post-backward hook on a
// unit's inputs, made to cover the tensors a unit reads beside its input.
// The unit computes on an alias of its input (a node of the call), so the
// input is one edge out and a path from any tensor of the call to it (a
// tensor kept by the module and used by the caller) is waited for too.
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <functional>
#include <utility>
#include <vector>

#include "cohort/fsdp/fsdp_state.h"

namespace cohort::fsdp {

namespace {

class RanHook : public torch::autograd::FunctionPostHook {
 public:
  explicit RanHook(std::function<void()> ran) : ran_(std::move(ran)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    ran_();
    return outputs;
  }

 private:
  std::function<void()> ran_;
};

}  // namespace

torch::Tensor FSDPState::watch_call(size_t u, const torch::Tensor& input) {
  call_watch_[u].reset();
  if (!torch::GradMode::is_enabled()) return input;
  auto call = std::make_shared<CallWatch>();
  call->unit = u;
  call->first = at::sequence_number::peek();
  call->thread = at::RecordFunction::currentThreadId();
  call_watch_[u] = call;
  if (!input.defined() || !input.requires_grad()) return input;
  return input.view_as(input);
}

bool FSDPState::accumulates_within(const torch::autograd::Node* node, size_t u) const {
  const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(node);
  if (!acc) return false;
  const auto it = param_unit_.find(acc->variable.unsafeGetTensorImpl());
  if (it == param_unit_.end()) return false;
  for (size_t v = it->second; v != kNone; v = parent_[v]) {
    if (v == u) return true;
  }
  return false;
}

std::shared_ptr<FSDPState::CallWatch> FSDPState::hook_call(std::shared_ptr<CallWatch> call,
                                                           const torch::Tensor& output) {
  using torch::autograd::Node;
  const auto root = output.grad_fn();
  const uint64_t first = call->first, end = at::sequence_number::peek();
  auto inside = [&](const Node* n) {
    return n->thread_id() == call->thread && n->sequence_nr() >= first && n->sequence_nr() < end;
  };
  if (!root || !inside(root.get())) return nullptr;
  std::vector<char> seen(end - first, 0);
  std::vector<Node*> todo = {root.get()};
  seen[root->sequence_nr() - first] = 1;
  std::vector<Node*> hooked;
  while (!todo.empty()) {
    Node* n = todo.back();
    todo.pop_back();
    bool out = false, covered = false;
    for (const auto& e : n->next_edges()) {
      if (!e.is_valid()) continue;
      Node* next = e.function.get();
      if (inside(next)) {
        covered = true;
        char& s = seen[next->sequence_nr() - first];
        if (!s) todo.push_back(next);
        s = 1;
      } else if (accumulates_within(next, call->unit)) {
        covered = true;
      } else {
        out = true;
      }
    }
    if (out || !covered) hooked.push_back(n);
  }
  if (hooked.empty()) return nullptr;  // its gradients and inner units say when
  std::weak_ptr<FSDPState> self = shared_from_this();
  for (Node* n : hooked) {
    // The hooks live as long as the graph; so does the watch they hold.
    n->add_post_hook(std::make_unique<RanHook>([self, call, counted = uint64_t{0}]() mutable {
      if (auto state = self.lock()) state->call_node_ran(*call, counted);
    }));
  }
  call->ends = hooked.size();
  watched_after_[call->unit] = static_cast<int64_t>(outermost_forwards_);
  return call;
}

void FSDPState::call_node_ran(CallWatch& call, uint64_t& counted) {
  // Only in the backward that opened the call, once per hook.
  if (!in_backward_ || call.opened != backward_id_ || counted == backward_id_) return;
  counted = backward_id_;
  if (--call.left > 0) return;
  --open_[call.unit];
  settle(call.unit);
}

bool FSDPState::backward_over(size_t u) const {
  if (arrived_[u] < parts_[u]) return false;
  // Every call whose backward began has run its hooked nodes, the units
  // inside it are over, and a unit with a call hooked in a forward since
  // the last backward has a backward to wait for (its output's hook).
  const bool watched = watched_after_[u] >= static_cast<int64_t>(forwards_before_);
  return open_[u] == 0 && inside_open_[u] == 0 && (backward_started_[u] || !watched);
}

void FSDPState::settle(size_t u) {
  if (finished_[u]) {
    // A call whose backward began after the unit's was over (a unit called
    // twice, a second backward through a kept graph) gathered it again;
    // its parameters go once that call is over too. A unit without sync
    // keeps them to the end of backward, as its gradients.
    if (open_[u] == 0 && reducing_[u]) units_[u].group->reshard();
    return;
  }
  if (!backward_over(u)) return;
  finish_unit(u);
  // Its end may be what a unit around it waited for.
  for (size_t a = parent_[u]; a != kNone; a = parent_[a]) {
    if (!finished_[a] && backward_over(a)) finish_unit(a);
  }
}

}  // namespace cohort::fsdp
