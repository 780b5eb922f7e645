// defines: MixedPrecisionPolicy (FSDP2's), the dtypes a fully sharded unit
// computes and communicates in (every rank wraps a unit with the same one:
// unit_agreement.h).
//
// The sharded parameters keep their own dtype (float32 master weights: what
// the optimizer sees and updates). With param_dtype set, the unit casts its
// shard to param_dtype before the all-gather (bfloat16 halves its bytes),
// and its forward and backward compute with the full param_dtype
// parameters; backward's gradients are cast to reduce_dtype (none:
// param_dtype) for the reduce-scatter and land in the float32 shard's .grad.
#pragma once

#include <torch/types.h>

#include <optional>
#include <string>

namespace cohort {

/// The dtypes of one unit (FSDP2's MixedPrecisionPolicy; see the file comment).
struct MixedPrecisionPolicy {
  /// The dtype of the all-gather and of the unit's forward and backward
  /// (none: the parameters' own).
  std::optional<torch::Dtype> param_dtype;
  /// The dtype gradients are reduce-scattered in (none: param_dtype). The
  /// communicator sums float16 and bfloat16 in float32 on the wire, so on
  /// its engines a bfloat16 reduce_dtype rounds like FSDP2's but moves the
  /// bytes of float32.
  std::optional<torch::Dtype> reduce_dtype;
  /// The dtype the unit's floating output is cast to (none: left as computed).
  std::optional<torch::Dtype> output_dtype;
  /// Whether the unit casts its floating input to param_dtype.
  bool cast_forward_inputs = true;
};

namespace fsdp {

/// "{param_dtype=bfloat16, reduce_dtype=float32, ...}" (none: "none").
std::string describe(const MixedPrecisionPolicy& policy);

}  // namespace fsdp
}  // namespace cohort
