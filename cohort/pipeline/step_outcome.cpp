#include "cohort/pipeline/step_outcome.h"

#include <algorithm>
#include <exception>
#include <sstream>
#include <string>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort::pipeline {
namespace {

std::string who(const Communicator& group) {
  return "PipelineRuntime on rank " + std::to_string(group.rank()) + " of group " + group.name() +
         ": ";
}

// The same text on every rank but for the rank's own number.
std::string loss_error(const Communicator& group, const PipelineSchedule& schedule, int mb,
                       double numel) {
  const int last = schedule.num_stages - 1;
  const std::string where = "stage " + std::to_string(last) + " micro-batch " + std::to_string(mb) +
                            " (on rank " + std::to_string(schedule.stage_to_rank.back()) + ")";
  std::ostringstream os;
  os << who(group);
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

// An all-gather, not a broadcast from the last stage's rank: a send is
// refused, or a stage's code throws, on any rank, and every rank must learn
// of it. The texts travel only when there is one.
std::vector<double> share_step_outcome(Communicator& group, const PipelineSchedule& schedule,
                                       const StepLosses& mine, const StepFailure& failure) {
  enum : int { kNothing, kRefused, kThrew };
  const int m = schedule.num_microbatches;
  const int64_t width = m + 3;
  std::vector<double> words = mine.losses;
  words.resize(static_cast<size_t>(m), 0.0);
  words.push_back(mine.bad_mb);
  words.push_back(static_cast<double>(mine.bad_numel));
  words.push_back(!failure.stage_error.empty()    ? kThrew
                  : !failure.refused_send.empty() ? kRefused
                                                  : kNothing);
  torch::Tensor local = torch::tensor(words, torch::kFloat64);
  torch::Tensor all = torch::empty({group.size() * width}, torch::kFloat64);
  group.all_gather_into_tensor(all, local).wait();
  const double* got = all.data_ptr<double>();
  int worst = kNothing;
  for (int r = 0; r < group.size(); ++r)
    worst = std::max(worst, static_cast<int>(got[r * width + m + 2]));
  if (worst != kNothing) {
    std::string mine_text = failure.stage_error;
    if (!failure.refused_send.empty())
      mine_text += (mine_text.empty() ? "" : "; ") + failure.refused_send;
    std::string text = who(group);
    bool first = true;
    for (const auto& t : gather_texts(group, mine_text)) {
      if (t.empty()) continue;
      text += (first ? "" : "; ") + t;
      first = false;
    }
    if (worst == kRefused) throw InvalidArgument(text);
    if (!failure.original) throw StageError(text);
    try {
      std::rethrow_exception(failure.original);
    } catch (...) {
      std::throw_with_nested(StageError(text));
    }
  }
  const double* last = got + schedule.stage_to_rank.back() * width;
  if (last[m] >= 0)
    throw InvalidArgument(loss_error(group, schedule, static_cast<int>(last[m]), last[m + 1]));
  return std::vector<double>(last, last + m);
}

}  // namespace cohort::pipeline
