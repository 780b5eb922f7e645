#include "cohort/ddp/comm_hook.h"

#include <c10/util/Exception.h>

#include "cohort/compression/compressed_collectives.h"
#include "cohort/core/error.h"

namespace cohort {

Work AllReduceHook::run(Communicator& comm, GradBucket& bucket) {
  return comm.all_reduce(bucket.buffer, {ReduceOp::Avg});
}

std::string ReducedPrecisionHook::name() const {
  return wire_dtype_ == torch::kBFloat16 ? "bf16_compress" : "fp16_compress";
}

Work ReducedPrecisionHook::run(Communicator& comm, GradBucket& bucket) {
  if (bucket.buffer.scalar_type() != torch::kFloat32) {
    throw InvalidArgument("cohort: " + name() + " hook reduces float32 buckets");
  }
  compression::low_precision_all_reduce(comm, bucket.buffer, wire_dtype_);
  return Work();
}

Work CompressionHook::run(Communicator& comm, GradBucket& bucket) {
  if (bucket.buffer.scalar_type() != torch::kFloat32) {
    throw InvalidArgument("cohort: " + name() + " hook reduces float32 buckets");
  }
  compressor_->all_reduce(comm, bucket.buffer, bucket.index, bucket.gradients);
  return Work();
}

}  // namespace cohort
