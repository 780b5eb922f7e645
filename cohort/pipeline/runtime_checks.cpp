// PipelineRuntime's checks: at construction each rank's own input, then one
// exchange so that every rank reports the same error; at each step the
// batch, the same way.
#include <sstream>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/pipeline/boundary_channel.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/pipeline/schedule_validator.h"

namespace cohort::pipeline {
namespace {

// The schedule as ranks compare it: its name and a digest of every rank's
// action list, so that two schedules of one shape but another order (GPipe
// on one rank, 1F1B on the next) are told apart before their messages
// cross.
std::string schedule_text(const PipelineSchedule& s) {
  std::vector<int64_t> words;
  for (const auto& list : s.actions) {
    words.push_back(static_cast<int64_t>(list.size()));
    for (const Action& a : list)
      words.insert(words.end(), {a.stage, static_cast<int64_t>(a.type), a.microbatch});
  }
  std::ostringstream os;
  os << s.name << " (actions digest " << std::hex << fnv1a_words(words) << ")";
  return os.str();
}

}  // namespace

void PipelineRuntime::check_local(const std::string& who) const {
  if (stages_.empty()) throw InvalidArgument(who + "empty stage list (every rank holds a stage)");
  if (!loss_fn_) throw InvalidArgument(who + "no loss function");
  if (options_.recv_window < 0)
    throw InvalidArgument(who + "recv_window is " + std::to_string(options_.recv_window) +
                          " (0 or more receive actions posted ahead)");
  if (schedule_.num_microbatches <= 0)
    throw InvalidArgument(who + "zero micro-batches (schedule " + schedule_.name + ")");
  if (schedule_.num_microbatches > kMetaMicrobatch)
    throw InvalidArgument(who + "schedule " + schedule_.name + " has " +
                          std::to_string(schedule_.num_microbatches) +
                          " micro-batches, more than the 65535 a message tag can number");
  if (schedule_.num_stages > kMaxStages)
    throw InvalidArgument(who + "schedule " + schedule_.name + " has " +
                          std::to_string(schedule_.num_stages) + " stages, more than the " +
                          std::to_string(kMaxStages) + " whose message tags fit in an int");
  if (schedule_.num_ranks != group_->size())
    throw InvalidArgument(who + "schedule " + schedule_.name + " is for " +
                          std::to_string(schedule_.num_ranks) + " ranks, the group has " +
                          std::to_string(group_->size()));
  validate_schedule(schedule_);
  auto expected = schedule_.stages_of(group_->rank());
  std::vector<int> have;
  for (const auto& st : stages_) have.push_back(st.index());
  if (have != expected) {
    std::ostringstream os;
    os << who << "holds stages [";
    for (size_t i = 0; i < have.size(); ++i) os << (i ? ", " : "") << have[i];
    os << "], the schedule maps [";
    for (size_t i = 0; i < expected.size(); ++i) os << (i ? ", " : "") << expected[i];
    os << "] to it" << (expected.empty() ? " (a rank with no stage)" : "");
    throw InvalidArgument(os.str());
  }
}

// Every rank joins this exchange, even one whose local checks failed, so
// that one rank's bad input or a disagreement is an error on every rank and
// never leaves the others waiting.
void PipelineRuntime::check_agreement(const std::string& who, const std::string& local_error) {
  // stages, micro-batches, local stages, ok, a digest of the stage-to-rank
  // map, then the schedule's name and actions (text_words)
  const std::vector<int64_t> map(schedule_.stage_to_rank.begin(), schedule_.stage_to_rank.end());
  std::vector<int64_t> mine{schedule_.num_stages, schedule_.num_microbatches,
                            static_cast<int64_t>(stages_.size()), local_error.empty() ? 1 : 0,
                            static_cast<int64_t>(fnv1a_words(map))};
  constexpr size_t kFixed = 5;
  const std::vector<int64_t> text = text_words(local_error.empty() ? schedule_text(schedule_) : "");
  mine.insert(mine.end(), text.begin(), text.end());
  const RankWords all = gather_words(*group_, mine);
  if (!local_error.empty()) throw InvalidArgument(local_error);
  int64_t total_local = 0;
  for (int r = 0; r < all.ranks(); ++r) {
    if (all.of(r)[3] == 0)
      throw InvalidArgument(who + "rank " + std::to_string(r) +
                            " refused the pipeline (see its error)");
    total_local += all.of(r)[2];
  }
  const auto shape = all.values([](const int64_t* f) {
    return std::to_string(f[0]) + " stages, " + std::to_string(f[1]) + " micro-batches";
  });
  if (!all_same(shape))
    throw InvalidArgument(who + "ranks disagree on the pipeline (" + name_groups(shape) + ")");
  // Every rank saw the same digests, so all of them take this branch or none.
  if (!all_same(all.values([](const int64_t* f) { return std::to_string(f[4]); })))
    throw InvalidArgument(who + describe_maps());
  // The same maps and counts, but other action lists: the ranks' messages
  // would not meet (a deadlock, or crossed micro-batches).
  std::vector<int64_t> texts;
  for (int r = 0; r < all.ranks(); ++r)
    texts.insert(texts.end(), all.of(r) + kFixed, all.of(r) + all.width());
  check_same_text(RankWords(std::move(texts), all.ranks()), who, "the schedule");
  if (total_local != schedule_.num_stages)
    throw InvalidArgument(who + "ranks hold " + std::to_string(total_local) +
                          " stages together, the schedule has " +
                          std::to_string(schedule_.num_stages));
}

// Collective: every rank's stage-to-rank map (the ranks agree on the number
// of stages), grouped by map, the first 64 entries of each.
std::string PipelineRuntime::describe_maps() const {
  constexpr int kShown = 64;
  const int n = schedule_.num_stages;
  const std::vector<int64_t> mine(schedule_.stage_to_rank.begin(), schedule_.stage_to_rank.end());
  const auto maps = gather_words(*group_, mine).values([&](const int64_t* map) {
    std::string text = "[";
    for (int s = 0; s < std::min(n, kShown); ++s) text += (s ? ", " : "") + std::to_string(map[s]);
    if (n <= kShown) return text + "]";
    // Maps that differ past the shown entries still form their own groups.
    const std::vector<int64_t> whole(map, map + n);
    return text + ", ...] (digest " + std::to_string(fnv1a_words(whole)) + ")";
  });
  std::string text = "ranks disagree on the stage-to-rank map (" + name_groups(maps) + ")";
  if (n > kShown)
    text += " (" + std::to_string(n) + " stages, the first " + std::to_string(kShown) + " shown)";
  return text;
}

// Collective: every rank learns each rank's problem with its batch, so that
// one rank's bad batch is an error on every rank before any of them posts a
// receive that would wait for it.
// Returns the digest of stage 0's input shapes, the key under which every
// rank's channel keeps the boundary shapes that batch shape gave.
int64_t PipelineRuntime::check_batches(const BatchProblem& mine) {
  const std::vector<int64_t> words{mine.kind, mine.of_targets, mine.rows, mine.input_shapes};
  const RankWords all = group_->size() == 1 ? RankWords(words, 1) : gather_words(*group_, words);
  std::ostringstream os;
  for (int r = 0; r < all.ranks(); ++r) {
    const int64_t* p = all.of(r);
    if (p[0] == BatchProblem::kNone) continue;
    const char* what = p[1] ? "targets" : "inputs";
    os << (os.tellp() > 0 ? "; " : "") << "rank " << r << " (stage "
       << (p[1] ? schedule_.num_stages - 1 : 0) << "): ";
    if (p[0] == BatchProblem::kEmpty)
      os << "no " << what;
    else
      os << "a batch of " << p[2] << " " << what << " does not split into "
         << schedule_.num_microbatches << " micro-batches";
  }
  if (os.tellp() > 0)
    throw InvalidArgument("PipelineRuntime::step on rank " + std::to_string(group_->rank()) +
                          " of group " + group_->name() + ": " + os.str());
  return all.ranks() == 1 ? words[3] : all.of(schedule_.stage_to_rank[0])[3];
}

}  // namespace cohort::pipeline
