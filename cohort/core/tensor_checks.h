// defines: the checks every tensor passes before it reaches an engine, and
// the dtype each one travels as.
//
// A wrong tensor is refused before anything is sent: a non-contiguous tensor
// would be sent in storage order and silently scrambled, so it is an error.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "cohort/core/types.h"
#include "cohort/core/work.h"

namespace cohort {

// "float32", "bfloat16", ... as torch names them.
std::string dtype_name(at::ScalarType t);
std::string shape_string(at::IntArrayRef sizes);

// Throws InvalidArgument naming `where` ("all_reduce on rank 0 of 2 ...") and
// `what` ("tensor", "outputs[3]") unless `t` is a defined, dense, contiguous
// CPU tensor of a supported dtype.
void check_tensor(const at::Tensor& t, const std::string& where, const std::string& what);

// The same checks, except that `t` may also be a CUDA tensor (one the
// Communicator stages through host memory).
void check_device_tensor(const at::Tensor& t, const std::string& where, const std::string& what);

// Same dtype and shape as `ref`.
void check_like(const at::Tensor& t, const at::Tensor& ref, const std::string& where,
                const std::string& what);

// The same checks naming `ctx`, which is described only when a check fails:
// describing it on every call cost about a microsecond per operation.
// check_tensor and check_like also accept a CUDA tensor when
// `ctx.device_tensors` (the engine moves it itself).
void check_tensor(const at::Tensor& t, const OpContext& ctx, const std::string& what);
void check_like(const at::Tensor& t, const at::Tensor& ref, const OpContext& ctx,
                const std::string& what);
void check_device_tensor(const at::Tensor& t, const OpContext& ctx, const std::string& what);

// The dtype a reduction runs in: f16 and bf16 accumulate in f32.
at::ScalarType reduction_dtype(at::ScalarType t);

// A view of `t` whose dtype every engine carries unchanged (data movement
// only: bf16 travels as f16 bits, bool as bytes).
at::Tensor movement_view(const at::Tensor& t);

// The memory of a contiguous tensor (as the checks above accept) as a flat
// uint8 view: a view, never a copy. A contiguous tensor of one element may
// have any stride, which view() refuses; this takes it too.
at::Tensor byte_view(const at::Tensor& t);

// `tensors` with each TensorImpl once, in the order of first occurrence.
// LibTorch's Module::parameters() lists a tensor registered under two names
// (a tied weight, a layer used twice) twice, where PyTorch's lists it once:
// a norm over such a list counts it twice, clipping scales it twice and an
// optimizer steps it twice.
std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors);

}  // namespace cohort
