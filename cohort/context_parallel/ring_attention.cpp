// The ring loops of forward and backward, and the autograd function that
// joins them. A step posts its transfer first and waits for it only after
// its block's attention, so the transfer runs on the engine's thread while
// this thread computes.
#include "cohort/context_parallel/ring_attention.h"

#include <torch/autograd.h>

#include <cmath>

#include "cohort/context_parallel/block_attention.h"
#include "cohort/context_parallel/input_agreement.h"
#include "cohort/core/error.h"
#include "cohort/core/once_differentiable.h"

namespace cohort::context_parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// One hop around the ring: `outgoing` to rank+1, a block of rank `from`'s
// size from rank-1. The outgoing tensor stays referenced until wait().
struct Hop {
  torch::Tensor outgoing;
  torch::Tensor incoming;
  std::vector<Work> works;

  void wait() {
    wait_all(works);
    works.clear();
  }
};

// Everything a ring step needs to know about the call.
struct Ring {
  Communicator& group;
  ZigZagLayout layout;
  RingAttentionOptions options;
  std::vector<int64_t> block_shape;  // [2, B, H, rows, D] with rows filled in per rank

  int rank() const { return group.rank(); }
  int cp() const { return group.size(); }
  // Whose block this rank holds at ring step s.
  int source(int s) const { return (rank() - s + cp()) % cp(); }

  // The shape of rank `owner`'s K/V block (ranks' rows differ by at most one).
  std::vector<int64_t> shape_of(int owner) const {
    auto shape = block_shape;
    shape[3] = layout.local_length(owner);
    return shape;
  }

  // Posts the receive first, so the message never waits for its buffer.
  // Without overlap (a benchmark's baseline) the hop completes here.
  Hop pass(torch::Tensor outgoing, int from, int tag) const {
    Hop hop{std::move(outgoing), {}, {}};
    hop.incoming = torch::empty(shape_of(from), hop.outgoing.options());
    const int next = (rank() + 1) % cp();
    const int prev = (rank() - 1 + cp()) % cp();
    hop.works.push_back(group.recv(hop.incoming, prev, {options.tag + tag, options.timeout}));
    hop.works.push_back(group.send(hop.outgoing, next, {options.tag + tag, options.timeout}));
    if (!options.overlap) hop.wait();
    return hop;
  }
};

std::pair<torch::Tensor, torch::Tensor> ring_forward(const Ring& ring, const torch::Tensor& q,
                                                     const torch::Tensor& kv, double scale) {
  auto state = start_softmax(q);
  auto block = kv;
  for (int s = 0; s < ring.cp(); ++s) {
    const bool more = s + 1 < ring.cp();
    Hop hop;
    if (more) hop = ring.pass(block, ring.source(s + 1), s);
    if (s != ring.options.skip_step) {
      for (const auto& piece : visible_pieces(ring.layout, ring.rank(), ring.source(s))) {
        accumulate(state, q, block[0], block[1], piece, scale);
      }
    }
    if (more) {
      hop.wait();
      block = hop.incoming;
    }
  }
  return finish_softmax(state);
}

// Returns dq and this rank's dK/dV ([2, B, H, L, D]). The accumulator of a
// block travels one step behind the block: each rank adds its queries'
// share and passes it on, and after cp hops it is back with the block's
// owner, complete.
std::pair<torch::Tensor, torch::Tensor> ring_backward(const Ring& ring, const QuerySide& side,
                                                      const torch::Tensor& kv) {
  auto dq = torch::zeros_like(side.q);
  auto block = kv;
  Hop grads;  // the accumulator arriving for this step's block
  for (int s = 0; s < ring.cp(); ++s) {
    const bool more = s + 1 < ring.cp();
    Hop hop;
    if (more) hop = ring.pass(block, ring.source(s + 1), ring.cp() + s);
    auto dkv = torch::zeros(ring.shape_of(ring.source(s)), kv.options());
    if (s != ring.options.skip_step) {
      auto dk = dkv[0];
      auto dv = dkv[1];
      for (const auto& piece : visible_pieces(ring.layout, ring.rank(), ring.source(s))) {
        accumulate_grads(side, block[0], block[1], piece, dq, dk, dv);
      }
    }
    if (s > 0) {
      grads.wait();
      dkv.add_(grads.incoming);
    }
    if (ring.cp() == 1) return {dq, dkv};
    grads = ring.pass(dkv, ring.source(s + 1), 2 * ring.cp() + s);
    if (more) {
      hop.wait();
      block = hop.incoming;
    }
  }
  grads.wait();
  return {dq, grads.incoming};
}

// The options travel to backward in the context's IValue map.
void save_options(AutogradContext* ctx, const RingAttentionOptions& o) {
  ctx->saved_data["scale"] = o.scale;
  ctx->saved_data["tag"] = static_cast<int64_t>(o.tag);
  ctx->saved_data["timeout"] = static_cast<int64_t>(o.timeout.count());
  ctx->saved_data["overlap"] = o.overlap;
  ctx->saved_data["skip"] = static_cast<int64_t>(o.skip_step);
}

RingAttentionOptions load_options(AutogradContext* ctx) {
  RingAttentionOptions o;
  o.scale = ctx->saved_data["scale"].toDouble();
  o.tag = static_cast<int>(ctx->saved_data["tag"].toInt());
  o.timeout = Millis(ctx->saved_data["timeout"].toInt());
  o.overlap = ctx->saved_data["overlap"].toBool();
  o.skip_step = static_cast<int>(ctx->saved_data["skip"].toInt());
  return o;
}

// The group lives in the autograd context as a capsule: saved_data holds
// IValues only, and the graph must keep the group alive until backward.
struct GroupHolder : torch::CustomClassHolder {
  std::shared_ptr<Communicator> group;
};

struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor q, torch::Tensor k,
                               torch::Tensor v, std::shared_ptr<Communicator> group,
                               RingAttentionOptions options) {
    const Ring ring = make_ring(*group, q, k, v, options);
    torch::NoGradGuard no_grad;
    auto [out, lse] = ring_forward(ring, q, torch::stack({k, v}), ring.options.scale);
    auto holder = c10::make_intrusive<GroupHolder>();
    holder->group = std::move(group);
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(holder));
    ctx->saved_data["length"] = ring.layout.length();
    save_options(ctx, ring.options);
    ctx->save_for_backward({q, k, v, out, lse});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder =
        c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule());
    const auto options = load_options(ctx);
    const auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    Ring ring{*holder->group,
              ZigZagLayout(ctx->saved_data["length"].toInt(), holder->group->size()), options,
              block_shape_of(q)};
    auto dout = grads[0].contiguous();
    QuerySide side{q.detach(), dout, saved[4], (dout * saved[3]).sum(-1), options.scale};
    auto [dq, dkv] =
        ring_backward(ring, side, torch::stack({saved[1].detach(), saved[2].detach()}));
    return once_differentiable({dq, dkv[0], dkv[1], torch::Tensor(), torch::Tensor()},
                               "ring_attention");
  }

  static std::vector<int64_t> block_shape_of(const torch::Tensor& q) {
    return {2, q.size(0), q.size(1), q.size(2), q.size(3)};
  }

  // Resolves the scale and agrees on it and the inputs (one all-gather).
  static Ring make_ring(Communicator& group, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, RingAttentionOptions& options) {
    if (options.scale == 0 && q.dim() == 4)
      options.scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
    auto layout = agree_inputs(q, k, v, group, options.timeout, options.scale);
    return Ring{group, layout, options, block_shape_of(q)};
  }
};

}  // namespace

torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::shared_ptr<Communicator>& group,
                             const RingAttentionOptions& options) {
  if (!group) throw InvalidArgument("cohort: ring_attention: the cp group is null");
  return RingAttentionFunction::apply(q.contiguous(), k.contiguous(), v.contiguous(), group,
                                      options);
}

}  // namespace cohort::context_parallel
