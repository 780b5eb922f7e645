// defines: the helpers the Communicator's source files share (private to
// cohort/comm): fingerprints for the debug check, each collective's
// signature and its check where no engine collective carries it, how
// reductions are put on the wire (avg as sum, f16/bf16 in f32) and taken
// off it.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/comm/device_staging.h"
#include "cohort/comm/order_keys.h"
#include "cohort/core/algorithm.h"
#include "cohort/core/engine.h"
#include "cohort/core/signature.h"
#include "cohort/core/tensor_checks.h"
#include "cohort/core/types.h"
#include "cohort/core/work_then.h"

namespace cohort::detail {

// "all_reduce(op=sum, dtype=float32, shape=[4])": what COHORT_DEBUG=detail
// compares across ranks.
inline std::string fingerprint(const std::string& op, const torch::Tensor& t,
                               const std::string& extra = {}) {
  std::string s = op + "(";
  if (!extra.empty()) s += extra + ", ";
  return s + "dtype=" + dtype_name(t.scalar_type()) + ", shape=" + shape_string(t.sizes()) + ")";
}

// The signature of a collective on `t` as the caller asked for it (the
// engine sees avg as sum, float16 as float32), waited for as long as the
// operation.
inline Signature call_signature(const OpContext& ctx, CollectiveKind kind, const torch::Tensor& t,
                                int64_t root = -1, std::optional<ReduceOp> op = std::nullopt) {
  auto s = signature_of(kind, t, root, op);
  s.timeout = ctx.timeout;
  return s;
}

// The signature of a coalesced collective: every tensor's elements, their
// dtype when they share one (-1 when they do not), and their layout (each
// one's dtype and elements in order): the engine moves one flat buffer, which
// each rank cuts into its own tensors.
inline Signature coalesced_signature(const OpContext& ctx, CollectiveKind kind,
                                     const std::vector<torch::Tensor>& ts) {
  Signature s;
  s.kind = kind;
  s.timeout = ctx.timeout;
  s.layout = layout_of(ts);
  s.count = 0;
  s.dtype = ts.empty() ? -1 : static_cast<int>(ts[0].scalar_type());
  for (auto& t : ts) {
    if (static_cast<int>(t.scalar_type()) != s.dtype) s.dtype = -1;
    s.count += t.numel();
  }
  return s;
}

// Where no engine collective carries a call's signature (nothing to move,
// or an algorithm over point-to-point), an engine barrier carries it: its
// Work fails with a MismatchError when the ranks' signatures differ.
inline WorkPtr check_signature(Engine& engine, const Signature& s) {
  SignatureScope scope(s);
  return engine.barrier();
}

// check_signature, waited for: null when the ranks agree, else its Work,
// which rethrows the error.
WorkPtr agree(Engine& engine, const Signature& s, Millis timeout);

// The algorithm a collective runs with (`resolve`), decided only after the
// ranks agreed on its signature unless it is the engine's own (whose
// collective carries the check): an algorithm's private engine and the
// adaptive choice's calibration are collective too, and ranks that called
// different collectives must not reach them. `failed` receives the failed
// check.
template <class Resolve>
Algorithm resolve_agreed(Engine& engine, const Signature& s, Millis timeout, Algorithm requested,
                         Resolve&& resolve, WorkPtr& failed) {
  const bool early = requested != Algorithm::Engine;
  if (early && (failed = agree(engine, s, timeout))) return Algorithm::Engine;
  const Algorithm a = resolve();
  if (a != Algorithm::Engine && !early) failed = agree(engine, s, timeout);
  return a;
}

// Collectives move data, not autograd history, as c10d's do: a tensor that
// requires grad (a parameter) takes part through an alias without it, so the
// engines may write into leaves and no output picks up a graph. Tensors that
// do not require grad pass as they are (no cost on the common path).
inline torch::Tensor data_of(const torch::Tensor& t) { return t.requires_grad() ? t.detach() : t; }
template <class Tensors>  // std::vector<torch::Tensor>, const or not
Tensors& data_of(Tensors& ts, std::vector<torch::Tensor>& aliases) {
  if (std::none_of(ts.begin(), ts.end(), [](const torch::Tensor& t) { return t.requires_grad(); }))
    return ts;
  aliases.clear();
  for (const auto& t : ts) aliases.push_back(data_of(t));
  return aliases;
}

// Whether an operation stages its device tensors through host memory: one
// of them is on a device (`any_device`) and `engine` moves host memory only.
inline bool stages(const Engine& engine, bool any_device) {
  return any_device && !engine.carries_device_tensors();
}

// The staging of `op`'s CUDA tensors through host memory on `comm`
// (device_staging.h): each public operation given one stages them and runs
// itself again on the host tensors.
inline DeviceStaging staging(const Communicator& comm, const char* op) {
  return DeviceStaging([&comm, op] {
    OpContext ctx;
    ctx.op = op;
    ctx.group = comm.name();
    ctx.rank = comm.rank();
    ctx.size = comm.size();
    return ctx.describe();
  });
}

// The bytes a tensor holds (what a trace event's "bytes" names).
inline int64_t nbytes(const torch::Tensor& t) { return t.numel() * t.element_size(); }

// Overlapping buffers. The engines read an operation's input while they
// write its output (c10d's Gloo and UCX work on the two buffers directly,
// MPI forbids overlap outside MPI_IN_PLACE), so an input that shares bytes
// with an output would be overwritten before it is sent: all_to_all_single
// in place gave a rank its own block for a peer's. The Communicator hands
// the engines separate buffers: an input whose bytes overlap an output's is
// cloned first, a copy paid only by calls that overlap. The one overlap
// every engine and algorithm handles, and which is not cloned, is the
// in-place form of the gathers and reduce-scatters: the input is exactly
// this rank's own block of the output (or the output exactly its own block
// of the input). Tensors here are contiguous (checked), so their bytes are
// one range.
inline bool overlaps(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined() || nbytes(a) == 0 || nbytes(b) == 0) return false;
  const auto* pa = static_cast<const char*>(a.data_ptr());
  const auto* pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + nbytes(b) && pb < pa + nbytes(a);
}
// The same bytes exactly.
inline bool same_bytes(const torch::Tensor& a, const torch::Tensor& b) {
  return a.data_ptr() == b.data_ptr() && nbytes(a) == nbytes(b);
}
// True when `t` overlaps one of `blocks` other than being exactly block
// `own` (-1: none is exempt).
inline bool overlaps_other_than_own(const torch::Tensor& t,
                                    const std::vector<torch::Tensor>& blocks, int own) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (!overlaps(t, blocks[i])) continue;
    if (static_cast<int>(i) == own && same_bytes(t, blocks[i])) continue;
    return true;
  }
  return false;
}

// Engines reduce Sum, Min, Max, Prod; avg is a sum divided afterwards.
inline ReduceOp engine_op(ReduceOp op) { return op == ReduceOp::Avg ? ReduceOp::Sum : op; }

// The tensor a reduction runs on: the caller's own tensor when its dtype
// reduces natively, else an f32 copy that is copied back afterwards; a
// floating min or max on an engine that drops NaN runs on order keys
// (order_keys.h), a new tensor.
inline torch::Tensor reduction_buffer(const torch::Tensor& t, ReduceOp op, const Engine& engine) {
  auto dt = reduction_dtype(t.scalar_type());
  if (reduces_as_keys(engine, dt, op)) return to_order_keys(t.to(dt), op);
  return dt == t.scalar_type() ? t : t.to(dt);
}

// After a reduction into `buf` (reduction_buffer's): decode or average, then
// copy into `out` if they differ.
inline void finish_reduction(torch::Tensor& out, torch::Tensor& buf, ReduceOp op, int size) {
  if (holds_order_keys(out, buf)) return order_keys_into(buf, out);
  if (op == ReduceOp::Avg) buf.div_(size);
  if (!buf.is_same(out)) out.copy_(buf);
}

// `count` views of `shape` into consecutive blocks of n elements of `flat`.
inline std::vector<torch::Tensor> flat_chunks(const torch::Tensor& flat, int64_t n, int count,
                                              at::IntArrayRef shape) {
  std::vector<torch::Tensor> chunks;
  chunks.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) chunks.push_back(flat.narrow(0, i * n, n).view(shape));
  return chunks;
}

}  // namespace cohort::detail
