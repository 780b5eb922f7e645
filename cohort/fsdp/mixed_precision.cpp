#include "cohort/fsdp/mixed_precision.h"

#include <sstream>

#include "cohort/core/tensor_checks.h"

namespace cohort::fsdp {
namespace {

std::string name(const std::optional<torch::Dtype>& dtype) {
  return dtype ? dtype_name(*dtype) : "none";
}

}  // namespace

std::string describe(const MixedPrecisionPolicy& p) {
  std::ostringstream os;
  os << "{param_dtype=" << name(p.param_dtype) << ", reduce_dtype=" << name(p.reduce_dtype)
     << ", output_dtype=" << name(p.output_dtype)
     << ", cast_forward_inputs=" << (p.cast_forward_inputs ? "true" : "false") << "}";
  return os.str();
}

}  // namespace cohort::fsdp
