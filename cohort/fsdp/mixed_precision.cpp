#include "cohort/fsdp/mixed_precision.h"

#include <algorithm>
#include <sstream>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"

namespace cohort::fsdp {
namespace {

constexpr int64_t kNone = -1;
constexpr int64_t kFields = 4;

int64_t code(const std::optional<torch::Dtype>& dtype) {
  return dtype ? static_cast<int64_t>(*dtype) : kNone;
}

std::optional<torch::Dtype> dtype_of(int64_t code) {
  if (code == kNone) return std::nullopt;
  return static_cast<torch::Dtype>(code);
}

MixedPrecisionPolicy decode(const int64_t* d) {
  MixedPrecisionPolicy p;
  p.param_dtype = dtype_of(d[0]);
  p.reduce_dtype = dtype_of(d[1]);
  p.output_dtype = dtype_of(d[2]);
  p.cast_forward_inputs = d[3] != 0;
  return p;
}

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

void verify_same_policy(Communicator& comm, const MixedPrecisionPolicy& policy,
                        const std::string& who) {
  const int n = comm.size();
  if (n == 1) return;
  auto mine = torch::tensor({code(policy.param_dtype), code(policy.reduce_dtype),
                             code(policy.output_dtype), int64_t{policy.cast_forward_inputs}},
                            torch::kLong);
  auto all = torch::empty({n * kFields}, torch::kLong);
  comm.all_gather_into_tensor(all, mine).wait();
  // Every rank sees the same table, so every rank names the same culprit.
  const int64_t* d = all.data_ptr<int64_t>();
  for (int r = 1; r < n; ++r) {
    if (std::equal(d, d + kFields, d + r * kFields)) continue;
    throw MismatchError(
        who + " on rank " + std::to_string(comm.rank()) + " of " + std::to_string(n) +
        ": the mixed precision policy differs across ranks: " + describe(decode(d)) +
        " on rank 0 but " + describe(decode(d + r * kFields)) + " on rank " + std::to_string(r));
  }
}

}  // namespace cohort::fsdp
