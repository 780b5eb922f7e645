// The Communicator's data movement: broadcast (plain and coalesced),
// all_gather (list and flat forms), gather, scatter, all-to-all. Data moves
// as bytes of its own dtype (bf16 as f16 bits, movement_view), so nothing is
// converted on the way.
#include <c10/util/accumulate.h>

#include <algorithm>
#include <numeric>

#include "cohort/algorithms/executor.h"
#include "cohort/comm/collective_checker.h"
#include "cohort/comm/communicator.h"
#include "cohort/comm/communicator_internal.h"
#include "cohort/comm/in_flight.h"
#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"

namespace cohort {

using detail::fingerprint;

namespace {

// A collective with nothing to move: alone, done; else its signature is
// still compared, so ranks that moved something else get an error.
WorkPtr nothing_to_move(Engine& engine, int size, const Signature& s) {
  return size == 1 ? done_work() : detail::check_signature(engine, s);
}

// An all_to_all's block from this rank to itself moves from its input to
// its output inside the engine, where no peer's check sees it: another size
// in than out would be broadcast, cut or refused by the engine on this rank
// alone. In a group the signature carries the flag (own_block_differs), so
// every rank refuses the call (a refusal here alone would leave the peers
// waiting); alone, this is the call's error. `in` and `out` say where the
// block is.
std::string own_block_refusal(const std::string& in, const std::string& out) {
  return "this rank's own block is " + in + " but " + out +
         ": its input and output must give a rank's own block the same size";
}

}  // namespace

Work Communicator::broadcast(torch::Tensor& caller_tensor, const BroadcastOptions& opts) {
  detail::Access access;
  if (rank_ == opts.root) {
    access.read(caller_tensor);
  } else {
    access.write(caller_tensor);
  }
  if (detail::stages(*engine_, detail::on_device(caller_tensor))) {
    settle(access);
    auto s = detail::staging(*this, "broadcast");
    auto host = s.write(caller_tensor, "tensor", /*also_read=*/rank_ == opts.root);
    s.ready();
    return track_in_flight(access, s.finish(broadcast(host, opts)));
  }
  auto tensor = detail::data_of(caller_tensor);
  auto call = begin_collective("broadcast", opts.timeout, access);
  check_root(call, opts.root);
  check_tensor(tensor, call.ctx, "tensor");
  call.bytes = detail::nbytes(tensor);
  debug_check(
      call, [&] { return fingerprint("broadcast", tensor, "root=" + std::to_string(opts.root)); });
  const auto sig = detail::call_signature(call.ctx, CollectiveKind::Broadcast, tensor, opts.root);
  if (tensor.numel() == 0) return finish(call, nothing_to_move(*engine_, size_, sig));
  auto wire = movement_view(tensor);
  SignatureScope scope(sig);
  return finish(call, engine_->broadcast(wire, opts.root));
}

Work Communicator::broadcast_coalesced(std::vector<torch::Tensor>& caller_tensors,
                                       const BroadcastOptions& opts) {
  detail::Access access;
  if (rank_ == opts.root) {
    access.read(caller_tensors);
  } else {
    access.write(caller_tensors);
  }
  if (detail::stages(*engine_, detail::any_on_device(caller_tensors))) {
    settle(access);
    auto s = detail::staging(*this, "broadcast_coalesced");
    std::vector<torch::Tensor> host;
    for (size_t i = 0; i < caller_tensors.size(); ++i) {
      host.push_back(
          s.write(caller_tensors[i], "tensors[" + std::to_string(i) + "]", rank_ == opts.root));
    }
    s.ready();
    return track_in_flight(access, s.finish(broadcast_coalesced(host, opts)));
  }
  std::vector<torch::Tensor> tensors_aliases;
  auto& tensors = detail::data_of(caller_tensors, tensors_aliases);
  auto call = begin_collective("broadcast_coalesced", opts.timeout, access);
  check_root(call, opts.root);
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_tensor(tensors[i], call.ctx, "tensors[" + std::to_string(i) + "]");
  }
  debug_check(call, [&] {
    std::string print = "broadcast_coalesced(root=" + std::to_string(opts.root);
    for (auto& t : tensors) print += ", " + dtype_name(t.scalar_type()) + shape_string(t.sizes());
    return print + ")";
  });
  // Bytes are bytes: one flat uint8 buffer carries every dtype at once.
  int64_t total = 0;
  for (auto& t : tensors) total += t.numel() * t.element_size();
  call.bytes = total;
  auto sig = detail::coalesced_signature(call.ctx, CollectiveKind::BroadcastCoalesced, tensors);
  sig.root = opts.root;
  if (total == 0) return finish(call, nothing_to_move(*engine_, size_, sig));
  auto flat = torch::empty({total}, torch::kUInt8);
  if (rank_ == opts.root) {
    int64_t offset = 0;
    for (auto& t : tensors) {
      const int64_t n = t.numel() * t.element_size();
      flat.narrow(0, offset, n).copy_(byte_view(t));
      offset += n;
    }
  }
  WorkPtr impl;
  {
    SignatureScope scope(sig);
    impl = engine_->broadcast(flat, opts.root);
  }
  auto copy_back = [tensors, flat, root = opts.root, me = rank_]() mutable {
    if (me == root) return;
    int64_t offset = 0;
    for (auto& t : tensors) {
      const int64_t n = t.numel() * t.element_size();
      byte_view(t).copy_(flat.narrow(0, offset, n));
      offset += n;
    }
  };
  return finish(call, std::move(impl), std::move(copy_back));
}

Work Communicator::all_gather(std::vector<torch::Tensor>& caller_outputs,
                              const torch::Tensor& caller_input, const AllGatherOptions& opts) {
  detail::Access access;
  access.write(caller_outputs).read(caller_input);
  if (detail::stages(*engine_,
                     detail::any_on_device(caller_outputs) || detail::on_device(caller_input))) {
    settle(access);
    auto s = detail::staging(*this, "all_gather");
    auto out = s.write(caller_outputs, "outputs");
    auto in = s.read(caller_input, "input");
    s.ready();
    return track_in_flight(access, s.finish(all_gather(out, in, opts)));
  }
  std::vector<torch::Tensor> outputs_aliases;
  auto& outputs = detail::data_of(caller_outputs, outputs_aliases);
  auto input = detail::data_of(caller_input);
  auto call = begin_collective("all_gather", opts.timeout, access);
  check_tensor(input, call.ctx, "input");
  check_per_rank(call, outputs, input, "outputs");
  call.bytes = size_ * detail::nbytes(input);
  debug_check(call, [&] { return fingerprint("all_gather", input); });
  if (input.numel() == 0) {
    return finish(
        call, nothing_to_move(*engine_, size_,
                              detail::call_signature(call.ctx, CollectiveKind::AllGather, input)));
  }
  std::vector<torch::Tensor> wire_out;
  for (auto& o : outputs) wire_out.push_back(movement_view(o));
  return run_all_gather(call, std::move(wire_out), {}, input, opts);
}

Work Communicator::all_gather_into_tensor(torch::Tensor& caller_output,
                                          const torch::Tensor& caller_input,
                                          const AllGatherOptions& opts) {
  detail::Access access;
  access.write(caller_output).read(caller_input);
  if (detail::stages(*engine_,
                     detail::on_device(caller_output) || detail::on_device(caller_input))) {
    settle(access);
    auto s = detail::staging(*this, "all_gather_into_tensor");
    auto out = s.write(caller_output, "output");
    auto in = s.read(caller_input, "input");
    s.ready();
    return track_in_flight(access, s.finish(all_gather_into_tensor(out, in, opts)));
  }
  auto output = detail::data_of(caller_output);
  auto input = detail::data_of(caller_input);
  auto call = begin_collective("all_gather_into_tensor", opts.timeout, access);
  check_tensor(input, call.ctx, "input");
  check_tensor(output, call.ctx, "output");
  if (output.scalar_type() != input.scalar_type() || output.numel() != input.numel() * size_) {
    call.refuse("output (" + dtype_name(output.scalar_type()) + shape_string(output.sizes()) +
                ") must have the input's dtype and " + std::to_string(size_) + " times its " +
                std::to_string(input.numel()) + " elements");
  }
  call.bytes = detail::nbytes(output);
  debug_check(call, [&] { return fingerprint("all_gather_into_tensor", input); });
  if (input.numel() == 0) {
    return finish(
        call, nothing_to_move(*engine_, size_,
                              detail::call_signature(call.ctx, CollectiveKind::AllGather, input)));
  }
  auto flat = movement_view(output).view({-1});
  auto chunks = detail::flat_chunks(flat, input.numel(), size_, input.sizes());
  return run_all_gather(call, std::move(chunks), flat, input, opts);
}

Work Communicator::run_all_gather(const Call& call, std::vector<torch::Tensor> outputs,
                                  torch::Tensor flat, const torch::Tensor& input,
                                  const AllGatherOptions& opts) {
  auto wire_in = movement_view(input);
  // In place (the input is this rank's own block of the output) every path
  // handles; any other overlap is a copy (detail::overlaps).
  if (detail::overlaps_other_than_own(wire_in, outputs, rank_)) wire_in = wire_in.clone();
  const auto sig = detail::call_signature(call.ctx, CollectiveKind::AllGather, input);
  WorkPtr failed;
  const auto algo = detail::resolve_agreed(
      *engine_, sig, call.ctx.timeout,
      opts.algo == Algorithm::Default ? options_.algorithm : opts.algo,
      [&] {
        return resolve_algorithm(Collective::AllGather,
                                 size_ * input.numel() * input.element_size(), opts.algo);
      },
      failed);
  if (failed) return finish(call, failed);
  call.algo = algo;
  if (algo == Algorithm::Engine) {
    SignatureScope scope(sig);
    return finish(call, engine_->all_gather(outputs, wire_in));
  }
  if (flat.defined()) {
    return finish(call,
                  algorithms().all_gather(flat, wire_in.reshape({-1}), algo, call.ctx.timeout));
  }
  // The algorithms gather into one buffer; the list form copies out of it.
  flat = torch::empty({size_ * input.numel()}, wire_in.options());
  auto impl = algorithms().all_gather(flat, wire_in.reshape({-1}), algo, call.ctx.timeout);
  return finish(call, std::move(impl), [outputs, flat, n = input.numel()]() mutable {
    for (size_t i = 0; i < outputs.size(); ++i) {
      outputs[i].view({-1}).copy_(flat.narrow(0, static_cast<int64_t>(i) * n, n));
    }
  });
}

Work Communicator::gather(std::vector<torch::Tensor>& caller_outputs,
                          const torch::Tensor& caller_input, const GatherOptions& opts) {
  detail::Access access;
  access.read(caller_input);
  if (rank_ == opts.root) access.write(caller_outputs);
  if (detail::stages(*engine_, detail::on_device(caller_input) ||
                                   (rank_ == opts.root && detail::any_on_device(caller_outputs)))) {
    settle(access);
    auto s = detail::staging(*this, "gather");
    // Off the root the outputs are ignored, and left as they are.
    auto out = rank_ == opts.root ? s.write(caller_outputs, "outputs") : caller_outputs;
    auto in = s.read(caller_input, "input");
    s.ready();
    return track_in_flight(access, s.finish(gather(out, in, opts)));
  }
  std::vector<torch::Tensor> outputs_aliases;
  auto& outputs = detail::data_of(caller_outputs, outputs_aliases);
  auto input = detail::data_of(caller_input);
  auto call = begin_collective("gather", opts.timeout, access);
  check_root(call, opts.root);
  check_tensor(input, call.ctx, "input");
  const bool is_root = rank_ == opts.root;
  if (is_root) check_per_rank(call, outputs, input, "outputs (on the root)");
  debug_check(call,
              [&] { return fingerprint("gather", input, "root=" + std::to_string(opts.root)); });
  const auto sig = detail::call_signature(call.ctx, CollectiveKind::Gather, input, opts.root);
  if (input.numel() == 0) return finish(call, nothing_to_move(*engine_, size_, sig));
  std::vector<torch::Tensor> wire_out;
  if (is_root) {
    for (auto& o : outputs) wire_out.push_back(movement_view(o));
  }
  auto wire_in = movement_view(input);
  if (detail::overlaps_other_than_own(wire_in, wire_out, rank_)) wire_in = wire_in.clone();
  SignatureScope scope(sig);
  return finish(call, engine_->gather(wire_out, wire_in, opts.root));
}

Work Communicator::scatter(torch::Tensor& caller_output,
                           const std::vector<torch::Tensor>& caller_inputs,
                           const ScatterOptions& opts) {
  detail::Access access;
  access.write(caller_output);
  if (rank_ == opts.root) access.read(caller_inputs);
  if (detail::stages(*engine_, detail::on_device(caller_output) ||
                                   (rank_ == opts.root && detail::any_on_device(caller_inputs)))) {
    settle(access);
    auto s = detail::staging(*this, "scatter");
    auto out = s.write(caller_output, "output");
    auto in = rank_ == opts.root ? s.read(caller_inputs, "inputs") : caller_inputs;
    s.ready();
    return track_in_flight(access, s.finish(scatter(out, in, opts)));
  }
  auto output = detail::data_of(caller_output);
  std::vector<torch::Tensor> inputs_aliases;
  auto& inputs = detail::data_of(caller_inputs, inputs_aliases);
  auto call = begin_collective("scatter", opts.timeout, access);
  check_root(call, opts.root);
  check_tensor(output, call.ctx, "output");
  const bool is_root = rank_ == opts.root;
  if (is_root) check_per_rank(call, inputs, output, "inputs (on the root)");
  debug_check(call,
              [&] { return fingerprint("scatter", output, "root=" + std::to_string(opts.root)); });
  const auto sig = detail::call_signature(call.ctx, CollectiveKind::Scatter, output, opts.root);
  if (output.numel() == 0) return finish(call, nothing_to_move(*engine_, size_, sig));
  std::vector<torch::Tensor> wire_in;
  if (is_root) {
    for (auto& t : inputs) wire_in.push_back(movement_view(t));
  }
  auto wire_out = movement_view(output);
  // The root's inputs are read while its output is written: one that shares
  // bytes with the output (other than exactly its own, in place) is a copy.
  for (size_t i = 0; i < wire_in.size(); ++i) {
    const bool in_place = static_cast<int>(i) == rank_ && detail::same_bytes(wire_in[i], wire_out);
    if (detail::overlaps(wire_in[i], wire_out) && !in_place) {
      wire_in[i] = wire_in[i].clone();
    }
  }
  SignatureScope scope(sig);
  return finish(call, engine_->scatter(wire_out, wire_in, opts.root));
}

Work Communicator::all_to_all_single(torch::Tensor& caller_output,
                                     const torch::Tensor& caller_input,
                                     std::vector<int64_t> output_split_sizes,
                                     std::vector<int64_t> input_split_sizes,
                                     const AllToAllOptions& opts) {
  detail::Access access;
  access.write(caller_output).read(caller_input);
  if (detail::stages(*engine_,
                     detail::on_device(caller_output) || detail::on_device(caller_input))) {
    settle(access);
    auto s = detail::staging(*this, "all_to_all_single");
    auto out = s.write(caller_output, "output");
    auto in = s.read(caller_input, "input");
    s.ready();
    return track_in_flight(access,
                           s.finish(all_to_all_single(out, in, std::move(output_split_sizes),
                                                      std::move(input_split_sizes), opts)));
  }
  auto output = detail::data_of(caller_output);
  auto input = detail::data_of(caller_input);
  auto call = begin_collective("all_to_all_single", opts.timeout, access);
  check_tensor(input, call.ctx, "input");
  check_tensor(output, call.ctx, "output");
  auto bad = [&](const std::string& why) { call.refuse(why); };
  if (output.scalar_type() != input.scalar_type()) bad("output and input dtypes differ");
  if (input.dim() == 0 || output.dim() == 0) bad("tensors need at least one dimension");
  if (input.sizes().slice(1) != output.sizes().slice(1)) {
    bad("output and input differ beyond dim 0: " + shape_string(output.sizes()) + " vs " +
        shape_string(input.sizes()));
  }
  // Elements per row from the shape, not numel / rows: an input of no rows
  // still receives rows of this width.
  const int64_t row = c10::multiply_integers(input.sizes().slice(1));
  auto counts = [&](std::vector<int64_t>& splits, const torch::Tensor& t, const std::string& name) {
    if (splits.empty()) {
      if (t.size(0) % size_ != 0) {
        bad(name + " has " + std::to_string(t.size(0)) + " rows, not divisible by " +
            std::to_string(size_) + "; pass split sizes");
      }
      splits.assign(static_cast<size_t>(size_), t.size(0) / size_);
    }
    if (static_cast<int>(splits.size()) != size_)
      bad(name + " split sizes need one entry per rank");
    if (std::accumulate(splits.begin(), splits.end(), int64_t{0}) != t.size(0) ||
        std::any_of(splits.begin(), splits.end(), [](int64_t s) { return s < 0; })) {
      bad(name + " split sizes do not add up to its " + std::to_string(t.size(0)) + " rows");
    }
    std::vector<int64_t> elements;
    for (auto s : splits) elements.push_back(s * row);
    return elements;
  };
  auto out_counts = counts(output_split_sizes, output, "output");
  auto in_counts = counts(input_split_sizes, input, "input");
  const auto own = static_cast<size_t>(rank_);
  const bool own_differs = in_counts[own] != out_counts[own];
  if (own_differs && size_ == 1) {
    auto rows = [](int64_t n) { return std::to_string(n) + (n == 1 ? " row" : " rows"); };
    bad(own_block_refusal(rows(input_split_sizes[own]) + " of the input",
                          rows(output_split_sizes[own]) + " of the output"));
  }
  debug_check(call, [&] {
    return CollectiveChecker::with_blocks(
        "all_to_all_single(dtype=" + dtype_name(input.scalar_type()) +
            ", row=" + shape_string(input.sizes().slice(1)) + ")",
        in_counts, out_counts);
  });
  auto wire_out = movement_view(output).view({-1});
  auto wire_in = movement_view(input).view({-1});
  if (detail::overlaps(wire_in, wire_out)) wire_in = wire_in.clone();  // in place, or partly
  // The engine compares the elements each rank sends to each other rank.
  auto sig = detail::call_signature(call.ctx, CollectiveKind::AllToAll, input);
  sig.count = -1;
  sig.own_block_differs = own_differs;
  SignatureScope scope(sig);
  return finish(call, engine_->all_to_all(wire_out, wire_in, out_counts, in_counts));
}

Work Communicator::all_to_all(std::vector<torch::Tensor>& caller_outputs,
                              const std::vector<torch::Tensor>& caller_inputs,
                              const AllToAllOptions& opts) {
  detail::Access access;
  access.write(caller_outputs).read(caller_inputs);
  if (detail::stages(*engine_, detail::any_on_device(caller_outputs) ||
                                   detail::any_on_device(caller_inputs))) {
    settle(access);
    auto s = detail::staging(*this, "all_to_all");
    auto out = s.write(caller_outputs, "outputs");
    auto in = s.read(caller_inputs, "inputs");
    s.ready();
    return track_in_flight(access, s.finish(all_to_all(out, in, opts)));
  }
  std::vector<torch::Tensor> outputs_aliases;
  auto& outputs = detail::data_of(caller_outputs, outputs_aliases);
  std::vector<torch::Tensor> inputs_aliases;
  auto& inputs = detail::data_of(caller_inputs, inputs_aliases);
  auto call = begin_collective("all_to_all", opts.timeout, access);
  if (static_cast<int>(outputs.size()) != size_ || static_cast<int>(inputs.size()) != size_) {
    call.refuse("needs one input and one output per rank (" + std::to_string(size_) + "), got " +
                std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
  }
  for (int i = 0; i < size_; ++i) {
    check_tensor(inputs[i], call.ctx, "inputs[" + std::to_string(i) + "]");
    check_tensor(outputs[i], call.ctx, "outputs[" + std::to_string(i) + "]");
    if (inputs[i].scalar_type() != inputs[0].scalar_type() ||
        outputs[i].scalar_type() != inputs[0].scalar_type()) {
      call.refuse("all inputs and outputs need one dtype");
    }
  }
  const auto own = static_cast<size_t>(rank_);
  const bool own_differs = inputs[own].numel() != outputs[own].numel();
  if (own_differs && size_ == 1) {
    auto elements = [](int64_t n) {
      return std::to_string(n) + (n == 1 ? " element" : " elements");
    };
    call.refuse(own_block_refusal(elements(inputs[own].numel()) + " in inputs[0]",
                                  elements(outputs[own].numel()) + " in outputs[0]"));
  }
  std::vector<int64_t> in_counts, out_counts;
  for (int i = 0; i < size_; ++i) {
    in_counts.push_back(inputs[i].numel());
    out_counts.push_back(outputs[i].numel());
  }
  // The blocks' sizes may differ by rank (an MoE's token counts): they
  // must pair up, not be alike.
  debug_check(call, [&] {
    return CollectiveChecker::with_blocks(
        "all_to_all(dtype=" + dtype_name(inputs[0].scalar_type()) + ")", in_counts, out_counts);
  });
  std::vector<torch::Tensor> flat_in;
  int64_t out_total = 0;
  for (int i = 0; i < size_; ++i) {
    flat_in.push_back(movement_view(inputs[i]).reshape({-1}));
    out_total += outputs[i].numel();
  }
  auto wire_in = at::cat(flat_in);
  auto wire_out = torch::empty({out_total}, wire_in.options());
  auto sig = detail::call_signature(call.ctx, CollectiveKind::AllToAll, wire_in);
  sig.dtype = static_cast<int>(inputs[0].scalar_type());
  sig.count = -1;
  sig.own_block_differs = own_differs;
  WorkPtr impl;
  {
    SignatureScope scope(sig);
    impl = engine_->all_to_all(wire_out, wire_in, out_counts, in_counts);
  }
  return finish(call, std::move(impl), [outputs, wire_out]() mutable {
    int64_t offset = 0;
    for (auto& o : outputs) {
      movement_view(o).view({-1}).copy_(wire_out.narrow(0, offset, o.numel()));
      offset += o.numel();
    }
  });
}

}  // namespace cohort
