#include "cohort/grad_sync/comm_hook.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "cohort/compression/compressed_collectives.h"
#include "cohort/core/error.h"
#include "cohort/core/serial_worker.h"

namespace cohort {
namespace {

void check_float32(const GradBucket& bucket, const std::string& hook) {
  if (bucket.buffer.scalar_type() != torch::kFloat32) {
    throw InvalidArgument("cohort: " + hook + " hook reduces float32 buckets");
  }
}

// What a failed bucket's wait() names: the hook and bucket, this rank, the
// group and every other rank (a compressed collective talks to all).
OpContext bucket_context(const Communicator& comm, const std::string& hook, int64_t index) {
  OpContext ctx;
  ctx.op = hook + " hook (bucket " + std::to_string(index) + ")";
  ctx.group = comm.name();
  ctx.rank = comm.rank();
  ctx.size = comm.size();
  ctx.all_peers = true;
  ctx.timeout = comm.timeout();
  return ctx;
}

// Hands `reduce` to the hook's worker (started on first use). The job holds
// its own handles to the bucket's tensors: they outlive the caller's view.
// One FIFO thread per hook: buckets are launched in index order on every
// rank, so the worker issues their collectives in the same order everywhere.
// While a job runs, the hook's communicator belongs to the worker; DDP waits
// for every bucket before it issues a collective of its own.
Work run_on_worker(std::shared_ptr<SerialWorker>& worker, Communicator& comm,
                   const std::string& hook, int64_t index, std::function<void()> reduce) {
  if (!worker) {
    SerialWorker::Options options;
    options.refusal = "an earlier job of this hook failed";
    // The process-wide intra-op thread count (torch::set_num_threads) is
    // per-thread state under OpenMP: take it over, as autograd's threads do.
    options.on_start = [] { at::init_num_threads(); };
    worker = std::make_shared<SerialWorker>(std::move(options));
  }
  OpContext context = bucket_context(comm, hook, index);
  // No deadline of its own: a wait that times out gives the job 500 ms more.
  auto work = worker->submit(context.op, SerialWorker::Clock::time_point::min(),
                             [reduce = std::move(reduce)] {
                               torch::NoGradGuard no_grad;  // grad mode is per thread
                               reduce();
                             });
  return Work(std::move(work), std::move(context));
}

}  // namespace

Work AllReduceHook::run(Communicator& comm, GradBucket& bucket) {
  return comm.all_reduce(bucket.buffer, {ReduceOp::Avg});
}

std::string ReducedPrecisionHook::name() const {
  return wire_dtype_ == torch::kBFloat16 ? "bf16_compress" : "fp16_compress";
}

Work ReducedPrecisionHook::run(Communicator& comm, GradBucket& bucket) {
  check_float32(bucket, name());
  return run_on_worker(worker_, comm, name(), bucket.index,
                       [&comm, buffer = bucket.buffer, wire = wire_dtype_]() mutable {
                         compression::low_precision_all_reduce(comm, buffer, wire);
                       });
}

Work CompressionHook::run(Communicator& comm, GradBucket& bucket) {
  check_float32(bucket, name());
  return run_on_worker(
      worker_, comm, name(), bucket.index,
      [&comm, compressor = compressor_, buffer = bucket.buffer, index = bucket.index,
       shaped = bucket.gradients, unused = bucket.unused]() mutable {
        compressor->hold(comm, index, unused);
        compressor->all_reduce(comm, buffer, index, shaped);
      });
}

std::map<std::string, torch::Tensor> CompressionHook::state() const {
  if (worker_) worker_->drain();
  return compressor_->state();
}

void CompressionHook::load_state(const std::map<std::string, torch::Tensor>& state) {
  if (worker_) worker_->drain();
  compressor_->load_state(state);
}

void CompressionHook::buckets_changed(const std::vector<int64_t>& indices) {
  if (worker_) worker_->drain();
  for (int64_t i : indices) compressor_->reset(i);
}

void CompressionHook::left_out(const Communicator& comm, int64_t index,
                               const std::vector<compression::ElementRange>& ranges) {
  if (worker_) worker_->drain();
  compressor_->put_back(comm, index, ranges);
}

}  // namespace cohort
