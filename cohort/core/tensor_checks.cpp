#include "cohort/core/tensor_checks.h"

#include <sstream>
#include <unordered_set>

#include "cohort/core/dtypes.h"
#include "cohort/core/error.h"

namespace cohort {

// The collectives' dtypes by their Python names; others (refused by
// check_tensor) as LibTorch spells them in C++, as the caller wrote them.
std::string dtype_name(at::ScalarType t) {
  const DtypeInfo* d = find_dtype(t);
  return d && d->collective ? d->name : c10::toString(t);
}

std::string shape_string(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < sizes.size(); ++i) os << (i ? ", " : "") << sizes[i];
  os << "]";
  return os.str();
}

namespace {
bool supported(at::ScalarType t) {
  const DtypeInfo* d = find_dtype(t);
  return d && d->collective;
}

std::string supported_names() {
  std::string names;
  for (const auto& d : kDtypes)
    if (d.collective) names += (names.empty() ? "" : ", ") + std::string(d.name);
  return names;
}
}  // namespace

namespace {
void check_dense(const at::Tensor& t, const std::string& where, const std::string& what,
                 bool cuda) {
  auto fail = [&](const std::string& why) {
    throw InvalidArgument("cohort: " + where + ": " + what + " " + why);
  };
  if (!t.defined()) fail("is undefined");
  if (t.layout() != at::kStrided) fail("is not a dense (strided) tensor");
  if (!t.device().is_cpu() && !(cuda && t.device().is_cuda())) {
    fail("is on device " + t.device().str() +
         (cuda ? "; cohort carries CPU and CUDA tensors" : "; this needs CPU tensors"));
  }
  if (!supported(t.scalar_type())) {
    fail("has dtype " + dtype_name(t.scalar_type()) + "; supported: " + supported_names());
  }
  if (!t.is_contiguous()) {
    fail("is not contiguous (shape " + shape_string(t.sizes()) + "); call .contiguous() first");
  }
}
}  // namespace

void check_tensor(const at::Tensor& t, const std::string& where, const std::string& what) {
  check_dense(t, where, what, false);
}

void check_device_tensor(const at::Tensor& t, const std::string& where, const std::string& what) {
  check_dense(t, where, what, true);
}

namespace {
void check_like_on(const at::Tensor& t, const at::Tensor& ref, const std::string& where,
                   const std::string& what, bool cuda) {
  check_dense(t, where, what, cuda);
  if (t.scalar_type() != ref.scalar_type()) {
    throw InvalidArgument("cohort: " + where + ": " + what + " has dtype " +
                          dtype_name(t.scalar_type()) + ", expected " +
                          dtype_name(ref.scalar_type()));
  }
  if (t.sizes() != ref.sizes()) {
    throw InvalidArgument("cohort: " + where + ": " + what + " has shape " +
                          shape_string(t.sizes()) + ", expected " + shape_string(ref.sizes()));
  }
}

}  // namespace

void check_like(const at::Tensor& t, const at::Tensor& ref, const std::string& where,
                const std::string& what) {
  check_like_on(t, ref, where, what, false);
}

namespace {
// True when check_tensor would accept `t` (or check_device_tensor, when
// `cuda`); the fast path of the OpContext forms.
bool passes(const at::Tensor& t, bool cuda = false) {
  return t.defined() && t.layout() == at::kStrided &&
         (t.device().is_cpu() || (cuda && t.device().is_cuda())) && supported(t.scalar_type()) &&
         t.is_contiguous();
}
}  // namespace

void check_tensor(const at::Tensor& t, const OpContext& ctx, const std::string& what) {
  if (!passes(t, ctx.device_tensors)) check_dense(t, ctx.describe(), what, ctx.device_tensors);
}

void check_device_tensor(const at::Tensor& t, const OpContext& ctx, const std::string& what) {
  if (!passes(t, true)) check_device_tensor(t, ctx.describe(), what);
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const OpContext& ctx,
                const std::string& what) {
  if (!passes(t, ctx.device_tensors) || t.scalar_type() != ref.scalar_type() ||
      t.sizes() != ref.sizes()) {
    check_like_on(t, ref, ctx.describe(), what, ctx.device_tensors);
  }
}

at::ScalarType reduction_dtype(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

at::Tensor byte_view(const at::Tensor& t) {
  if (!t.is_contiguous()) {
    throw InvalidArgument("byte_view: the tensor (shape " + shape_string(t.sizes()) +
                          ") is not contiguous");
  }
  return t.as_strided({t.numel()}, {1}).view(at::kByte);
}

at::Tensor movement_view(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return t.view(at::kHalf);
  return t;
}

std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& t : tensors) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

}  // namespace cohort
