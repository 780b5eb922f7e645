// The Communicator's reductions: all_reduce (plain and coalesced), reduce,
// reduce_scatter (list and flat forms). Each runs on a reduction buffer (the
// caller's tensor, or an f32 copy for f16/bf16), as a sum where avg was
// asked, then divides and copies back when its Work completes.
#include <algorithm>

#include "cohort/algorithms/executor.h"
#include "cohort/comm/communicator.h"
#include "cohort/comm/communicator_internal.h"
#include "cohort/comm/in_flight.h"
#include "cohort/core/error.h"

namespace cohort {
namespace {

void check_avg(const OpContext& ctx, const torch::Tensor& t, ReduceOp op) {
  if (op == ReduceOp::Avg && !at::isFloatingType(t.scalar_type())) {
    throw InvalidArgument("cohort: " + ctx.describe() + ": avg needs a floating-point dtype, got " +
                          dtype_name(t.scalar_type()));
  }
}

}  // namespace

using detail::engine_op;
using detail::fingerprint;
using detail::reduction_buffer;

Work Communicator::all_reduce(torch::Tensor& caller_tensor, const AllReduceOptions& opts) {
  detail::Access access;
  access.write(caller_tensor);
  if (detail::stages(*engine_, size_ > 1 && detail::on_device(caller_tensor))) {
    settle(access);
    auto s = detail::staging(*this, "all_reduce");
    auto host = s.write(caller_tensor, "tensor", /*also_read=*/true);
    s.ready();
    return track_in_flight(access, s.finish(all_reduce(host, opts)));
  }
  auto tensor = detail::data_of(caller_tensor);
  auto call = begin_collective("all_reduce", opts.timeout, access);
  check_device_tensor(tensor, call.ctx, "tensor");  // alone a device tensor stays where it is
  check_avg(call.ctx, tensor, opts.op);
  call.bytes = detail::nbytes(tensor);
  debug_check(call, [&] { return fingerprint("all_reduce", tensor, "op=" + to_string(opts.op)); });
  // Alone, every reduction (avg included) is the identity: no engine round
  // trip, no pass over the data (DDP at world 1 calls this every step).
  if (size_ == 1) return finish(call, done_work());
  const auto sig = detail::call_signature(call.ctx, CollectiveKind::AllReduce, tensor, -1, opts.op);
  if (tensor.numel() == 0) return finish(call, detail::check_signature(*engine_, sig));
  auto buf = reduction_buffer(tensor, opts.op, *engine_);
  WorkPtr failed;
  const auto algo = detail::resolve_agreed(
      *engine_, sig, call.ctx.timeout,
      opts.algo == Algorithm::Default ? options_.algorithm : opts.algo,
      [&] {
        return resolve_algorithm(Collective::AllReduce, buf.numel() * buf.element_size(),
                                 opts.algo);
      },
      failed);
  if (failed) return finish(call, failed);
  call.algo = algo;
  WorkPtr impl;
  if (algo == Algorithm::Engine) {
    SignatureScope scope(sig);
    impl = engine_->all_reduce(buf, engine_op(opts.op));
  } else {
    impl = algorithms().all_reduce(buf.view({-1}), engine_op(opts.op), algo, call.ctx.timeout);
  }
  return finish_reduction(call, std::move(impl), tensor, buf, opts.op);
}

Work Communicator::all_reduce_coalesced(std::vector<torch::Tensor>& caller_tensors,
                                        const AllReduceOptions& opts) {
  detail::Access access;
  access.write(caller_tensors);
  if (detail::stages(*engine_, size_ > 1 && detail::any_on_device(caller_tensors))) {
    settle(access);
    auto s = detail::staging(*this, "all_reduce_coalesced");
    std::vector<torch::Tensor> host;
    for (size_t i = 0; i < caller_tensors.size(); ++i) {
      host.push_back(s.write(caller_tensors[i], "tensors[" + std::to_string(i) + "]", true));
    }
    s.ready();
    return track_in_flight(access, s.finish(all_reduce_coalesced(host, opts)));
  }
  std::vector<torch::Tensor> tensors_aliases;
  auto& tensors = detail::data_of(caller_tensors, tensors_aliases);
  auto call = begin_collective("all_reduce_coalesced", opts.timeout, access);
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_device_tensor(tensors[i], call.ctx, "tensors[" + std::to_string(i) + "]");
    check_avg(call.ctx, tensors[i], opts.op);
    call.bytes += detail::nbytes(tensors[i]);
  }
  debug_check(call, [&] {
    std::string print = "all_reduce_coalesced(op=" + to_string(opts.op);
    for (auto& t : tensors) print += ", " + dtype_name(t.scalar_type()) + shape_string(t.sizes());
    return print + ")";
  });

  if (size_ == 1) return finish(call, done_work());
  auto sig = detail::coalesced_signature(call.ctx, CollectiveKind::AllReduceCoalesced, tensors);
  sig.op = static_cast<int>(opts.op);
  // The first engine collective carries the signature; with none, a check.
  std::optional<SignatureScope> scope;
  scope.emplace(sig);

  // One flat buffer per reduction dtype, in order of first appearance, which
  // is the same on every rank because the tensor lists match.
  std::vector<at::ScalarType> dtypes;
  for (auto& t : tensors) {
    auto dt = reduction_dtype(t.scalar_type());
    if (std::find(dtypes.begin(), dtypes.end(), dt) == dtypes.end()) dtypes.push_back(dt);
  }
  std::vector<WorkPtr> parts;
  std::vector<std::pair<torch::Tensor, std::vector<size_t>>> flats;
  for (auto dt : dtypes) {
    std::vector<size_t> members;
    std::vector<torch::Tensor> pieces;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (reduction_dtype(tensors[i].scalar_type()) != dt || tensors[i].numel() == 0) continue;
      members.push_back(i);
      pieces.push_back(tensors[i].reshape({-1}).to(dt));
    }
    if (members.empty()) continue;
    auto flat = at::cat(pieces);
    if (detail::reduces_as_keys(*engine_, dt, opts.op)) flat = detail::to_order_keys(flat, opts.op);
    parts.push_back(engine_->all_reduce(flat, engine_op(opts.op)));
    scope.reset();
    flats.emplace_back(flat, std::move(members));
  }
  if (scope) parts.push_back(engine_->barrier());
  auto copy_back = [tensors, flats, op = opts.op, n = size_]() mutable {
    for (auto& [flat, members] : flats) {
      if (op == ReduceOp::Avg) flat.div_(n);
      const auto values = detail::holds_order_keys(tensors[members.front()], flat)
                              ? detail::order_keys_to_values(flat)
                              : flat;
      int64_t offset = 0;
      for (size_t i : members) {
        auto& t = tensors[i];
        t.view({-1}).copy_(values.narrow(0, offset, t.numel()));
        offset += t.numel();
      }
    }
  };
  return finish(call, std::make_shared<WorkList>(std::move(parts)), std::move(copy_back));
}

Work Communicator::reduce(torch::Tensor& caller_tensor, const ReduceOptions& opts) {
  detail::Access access;
  access.write(caller_tensor);
  if (detail::stages(*engine_, size_ > 1 && detail::on_device(caller_tensor))) {
    settle(access);
    auto s = detail::staging(*this, "reduce");
    auto host = s.write(caller_tensor, "tensor", /*also_read=*/true);
    s.ready();
    return track_in_flight(access, s.finish(reduce(host, opts)));
  }
  auto tensor = detail::data_of(caller_tensor);
  auto call = begin_collective("reduce", opts.timeout, access);
  check_root(call, opts.root);
  check_device_tensor(tensor, call.ctx, "tensor");  // alone a device tensor stays where it is
  check_avg(call.ctx, tensor, opts.op);
  call.bytes = detail::nbytes(tensor);
  debug_check(call, [&] {
    return fingerprint("reduce", tensor,
                       "root=" + std::to_string(opts.root) + ", op=" + to_string(opts.op));
  });
  if (size_ == 1) return finish(call, done_work());
  const auto sig =
      detail::call_signature(call.ctx, CollectiveKind::Reduce, tensor, opts.root, opts.op);
  if (tensor.numel() == 0) return finish(call, detail::check_signature(*engine_, sig));
  auto buf = reduction_buffer(tensor, opts.op, *engine_);
  WorkPtr impl;
  {
    SignatureScope scope(sig);
    impl = engine_->reduce(buf, opts.root, engine_op(opts.op));
  }
  // Off the root the result is unspecified; the buffer lives until the end.
  if (rank_ != opts.root) return finish(call, std::move(impl), [buf] {});
  return finish_reduction(call, std::move(impl), tensor, buf, opts.op);
}

Work Communicator::reduce_scatter(torch::Tensor& caller_output,
                                  const std::vector<torch::Tensor>& caller_inputs,
                                  const ReduceScatterOptions& opts) {
  detail::Access access;
  access.write(caller_output).read(caller_inputs);
  if (detail::stages(*engine_,
                     detail::on_device(caller_output) || detail::any_on_device(caller_inputs))) {
    settle(access);
    auto s = detail::staging(*this, "reduce_scatter");
    auto out = s.write(caller_output, "output");
    auto in = s.read(caller_inputs, "inputs");
    s.ready();
    return track_in_flight(access, s.finish(reduce_scatter(out, in, opts)));
  }
  auto output = detail::data_of(caller_output);
  std::vector<torch::Tensor> inputs_aliases;
  auto& inputs = detail::data_of(caller_inputs, inputs_aliases);
  auto call = begin_collective("reduce_scatter", opts.timeout, access);
  check_tensor(output, call.ctx, "output");
  check_avg(call.ctx, output, opts.op);
  check_per_rank(call, inputs, output, "inputs");
  call.bytes = size_ * detail::nbytes(output);
  debug_check(call,
              [&] { return fingerprint("reduce_scatter", output, "op=" + to_string(opts.op)); });
  if (size_ == 1 && output.numel() == 0) return finish(call, done_work());
  if (output.numel() == 0) {
    return finish(
        call, detail::check_signature(
                  *engine_, detail::call_signature(call.ctx, CollectiveKind::ReduceScatter, output,
                                                   -1, opts.op)));
  }
  std::vector<torch::Tensor> chunks;
  for (auto& t : inputs) chunks.push_back(reduction_buffer(t, opts.op, *engine_));
  // An input that shares bytes with the output (other than exactly this
  // rank's own, in place) is a copy (detail::overlaps).
  for (size_t i = 0; i < chunks.size(); ++i) {
    const bool in_place = static_cast<int>(i) == rank_ && detail::same_bytes(chunks[i], output);
    if (detail::overlaps(chunks[i], output) && !in_place) {
      chunks[i] = chunks[i].clone();
    }
  }
  return run_reduce_scatter(call, output, std::move(chunks), {}, opts);
}

Work Communicator::reduce_scatter_tensor(torch::Tensor& caller_output,
                                         const torch::Tensor& caller_input,
                                         const ReduceScatterOptions& opts) {
  detail::Access access;
  access.write(caller_output).read(caller_input);
  if (detail::stages(*engine_,
                     detail::on_device(caller_output) || detail::on_device(caller_input))) {
    settle(access);
    auto s = detail::staging(*this, "reduce_scatter_tensor");
    auto out = s.write(caller_output, "output");
    auto in = s.read(caller_input, "input");
    s.ready();
    return track_in_flight(access, s.finish(reduce_scatter_tensor(out, in, opts)));
  }
  auto output = detail::data_of(caller_output);
  auto input = detail::data_of(caller_input);
  auto call = begin_collective("reduce_scatter_tensor", opts.timeout, access);
  check_tensor(output, call.ctx, "output");
  check_tensor(input, call.ctx, "input");
  check_avg(call.ctx, output, opts.op);
  if (output.scalar_type() != input.scalar_type() || input.numel() != output.numel() * size_) {
    call.refuse("input (" + dtype_name(input.scalar_type()) + shape_string(input.sizes()) +
                ") must have the output's dtype and " + std::to_string(size_) + " times its " +
                std::to_string(output.numel()) + " elements");
  }
  call.bytes = detail::nbytes(input);
  debug_check(call, [&] {
    return fingerprint("reduce_scatter_tensor", output, "op=" + to_string(opts.op));
  });
  if (size_ == 1 && output.numel() == 0) return finish(call, done_work());
  if (output.numel() == 0) {
    return finish(
        call, detail::check_signature(
                  *engine_, detail::call_signature(call.ctx, CollectiveKind::ReduceScatter, output,
                                                   -1, opts.op)));
  }
  auto flat = reduction_buffer(input, opts.op, *engine_).view({-1});
  auto chunks = detail::flat_chunks(flat, output.numel(), size_, output.sizes());
  // In place (the output is this rank's own block of the input) every path
  // handles; any other overlap is a copy of the input (detail::overlaps).
  if (detail::overlaps_other_than_own(output, chunks, rank_)) {
    flat = flat.clone();
    chunks = detail::flat_chunks(flat, output.numel(), size_, output.sizes());
  }
  return run_reduce_scatter(call, output, std::move(chunks), flat, opts);
}

Work Communicator::run_reduce_scatter(const Call& call, torch::Tensor& output,
                                      std::vector<torch::Tensor> chunks, torch::Tensor flat,
                                      const ReduceScatterOptions& opts) {
  // The output's keys are only written: an empty buffer of their dtype.
  const auto dt = reduction_dtype(output.scalar_type());
  auto buf = detail::reduces_as_keys(*engine_, dt, opts.op)
                 ? torch::empty(output.sizes(), output.options().dtype(detail::order_key_dtype(dt)))
                 : reduction_buffer(output, opts.op, *engine_);
  const auto sig =
      detail::call_signature(call.ctx, CollectiveKind::ReduceScatter, output, -1, opts.op);
  WorkPtr failed;
  const auto algo = detail::resolve_agreed(
      *engine_, sig, call.ctx.timeout,
      opts.algo == Algorithm::Default ? options_.algorithm : opts.algo,
      [&] {
        return resolve_algorithm(Collective::ReduceScatter,
                                 size_ * buf.numel() * buf.element_size(), opts.algo);
      },
      failed);
  if (failed) return finish(call, failed);
  call.algo = algo;
  WorkPtr impl;
  if (algo == Algorithm::Engine) {
    SignatureScope scope(sig);
    impl = engine_->reduce_scatter(buf, chunks, engine_op(opts.op));
  } else {
    if (!flat.defined()) {
      for (auto& c : chunks) c = c.reshape({-1});
      flat = at::cat(chunks);
    }
    impl = algorithms().reduce_scatter(buf.view({-1}), flat, engine_op(opts.op), algo,
                                       call.ctx.timeout);
  }
  return finish_reduction(call, std::move(impl), output, buf, opts.op);
}

}  // namespace cohort
