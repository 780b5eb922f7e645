#include "cohort/ddp/comm_hook.h"

#include <c10/util/Exception.h>

namespace cohort {
namespace {

// Exposes a public Work as an engine-side WorkImpl, so that a completion
// step can be chained after it (Work's own constructor takes the step).
class WaitOn : public WorkImpl {
 public:
  explicit WaitOn(Work inner) : inner_(std::move(inner)) {}
  bool is_completed() override { return inner_.is_completed(); }
  void wait(Millis timeout) override { inner_.wait(timeout); }

 private:
  Work inner_;
};

}  // namespace

Work AllReduceHook::run(Communicator& comm, GradBucket& bucket) {
  return comm.all_reduce(bucket.buffer, {ReduceOp::Avg});
}

std::string ReducedPrecisionHook::name() const {
  return wire_dtype_ == torch::kBFloat16 ? "bf16_compress" : "fp16_compress";
}

Work ReducedPrecisionHook::run(Communicator& comm, GradBucket& bucket) {
  // Divide before the cast (PyTorch's fp16_compress_hook does the same):
  // summing unscaled float16 gradients over many ranks can overflow.
  const int n = comm.size();
  auto wire = bucket.buffer.div(n).to(wire_dtype_);
  Work reduce = comm.all_reduce(wire, {ReduceOp::Sum});
  OpContext ctx;
  ctx.op = name() + " hook (bucket " + std::to_string(bucket.index) + ")";
  ctx.group = comm.name();
  ctx.rank = comm.rank();
  ctx.size = comm.size();
  ctx.timeout = comm.timeout();
  auto buffer = bucket.buffer;
  return Work(std::make_shared<WaitOn>(std::move(reduce)), std::move(ctx),
              [buffer, wire]() mutable { buffer.copy_(wire); });
}

}  // namespace cohort
