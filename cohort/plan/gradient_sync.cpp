#include "cohort/plan/gradient_sync.h"

#include <chrono>

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"
#include "cohort/grad_sync/average_gradients.h"
#include "cohort/grad_sync/parameter_check.h"

namespace cohort {

AllReduceGradientSync::AllReduceGradientSync(std::shared_ptr<Communicator> comm,
                                             std::vector<torch::Tensor> params)
    : comm_(std::move(comm)), params_(unique_tensors(params)) {
  if (!comm_) throw InvalidArgument("AllReduceGradientSync: the communicator is null");
  // Averaged over comm_, an expert split over ranks would be mixed with the
  // other ranks' experts.
  verify_not_rank_local(*comm_, params_, {}, "AllReduceGradientSync");
  // Averaged over ranks that hold other TP ranks' parts, the parts would mix.
  verify_same_tensor_parallel_parts(*comm_, params_, {}, "AllReduceGradientSync");
  // Nothing here broadcasts (as DDP's constructor does): every rank applies
  // the same averaged gradient to its own values, so replicas that start
  // apart would train apart, silently. One digest word per rank checks it.
  verify_same_parameters(*comm_, params_, {}, "AllReduceGradientSync");
  verify_same_values(*comm_, params_, {}, "AllReduceGradientSync",
                     "every rank applies the same averaged gradient to its own values, so the "
                     "ranks' models would silently stay different. Build it over parameters "
                     "equal on every rank: initialize them from the same seed or checkpoint on "
                     "every rank, or broadcast them from one rank first");
}

void AllReduceGradientSync::finish_sync() {
  if (comm_->size() == 1) return;
  const auto start = std::chrono::steady_clock::now();
  average_gradients(params_, *comm_);
  comm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void AllReduceGradientSync::finish_sync_unless_failed(const std::exception_ptr& failed) {
  if (comm_->size() == 1) {
    if (failed) std::rethrow_exception(failed);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  average_gradients(params_, *comm_, failed,
                    "AllReduceGradientSync on rank " + std::to_string(comm_->rank()) +
                        " of group " + comm_->name());
  comm_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace cohort
