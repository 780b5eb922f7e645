#include "cohort/pipeline/step_outcome.h"

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
// refused on the rank that makes it (any rank but the last stage's), and
// every rank must learn of it. The texts travel only when there is one.
std::vector<double> share_step_outcome(Communicator& group, const PipelineSchedule& schedule,
                                       const StepLosses& mine, const std::string& refused_send) {
  const int m = schedule.num_microbatches;
  const int64_t width = m + 3;
  std::vector<double> words = mine.losses;
  words.resize(static_cast<size_t>(m), 0.0);
  words.push_back(mine.bad_mb);
  words.push_back(static_cast<double>(mine.bad_numel));
  words.push_back(refused_send.empty() ? 0 : 1);
  torch::Tensor local = torch::tensor(words, torch::kFloat64);
  torch::Tensor all = torch::empty({group.size() * width}, torch::kFloat64);
  group.all_gather_into_tensor(all, local).wait();
  const double* got = all.data_ptr<double>();
  bool refused = false;
  for (int r = 0; r < group.size(); ++r) refused = refused || got[r * width + m + 2] != 0;
  if (refused) {
    std::string text = who(group);
    bool first = true;
    for (const auto& t : gather_texts(group, refused_send)) {
      if (t.empty()) continue;
      text += (first ? "" : "; ") + t;
      first = false;
    }
    throw InvalidArgument(text);
  }
  const double* last = got + schedule.stage_to_rank.back() * width;
  if (last[m] >= 0)
    throw InvalidArgument(loss_error(group, schedule, static_cast<int>(last[m]), last[m + 1]));
  return std::vector<double>(last, last + m);
}

}  // namespace cohort::pipeline
