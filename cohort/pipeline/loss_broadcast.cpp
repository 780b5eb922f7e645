#include "cohort/pipeline/loss_broadcast.h"

#include <sstream>
#include <string>

#include "cohort/core/error.h"

namespace cohort::pipeline {
namespace {

// The same text on every rank but for the rank's own number.
std::string loss_error(const Communicator& group, const PipelineSchedule& schedule, int mb,
                       double numel) {
  const int last = schedule.num_stages - 1;
  const std::string where = "stage " + std::to_string(last) + " micro-batch " + std::to_string(mb) +
                            " (on rank " + std::to_string(schedule.stage_to_rank.back()) + ")";
  std::ostringstream os;
  os << "PipelineRuntime on rank " << group.rank() << " of group " << group.name() << ": ";
  if (numel != 1) {
    os << "the loss function returned " << static_cast<int64_t>(numel) << " elements for " << where
       << ", not a scalar";
  } else {
    os << "the loss of " << where
       << " does not require grad (computed under NoGradGuard, or from detached outputs?): the "
          "step would train nothing";
  }
  return os.str();
}

}  // namespace

std::vector<double> broadcast_losses(Communicator& group, const PipelineSchedule& schedule,
                                     const StepLosses& mine) {
  // Per-micro-batch losses, then the first micro-batch whose loss was
  // refused (-1: none) and its size.
  std::vector<double> message = mine.losses;
  message.push_back(mine.bad_mb);
  message.push_back(static_cast<double>(mine.bad_numel));
  torch::Tensor losses = torch::tensor(message, torch::kFloat64);
  BroadcastOptions opts;
  opts.root = schedule.stage_to_rank.back();
  group.broadcast(losses, opts).wait();
  const double* got = losses.data_ptr<double>();
  const int m = schedule.num_microbatches;
  if (got[m] >= 0)
    throw InvalidArgument(loss_error(group, schedule, static_cast<int>(got[m]), got[m + 1]));
  return std::vector<double>(got, got + m);
}

}  // namespace cohort::pipeline
