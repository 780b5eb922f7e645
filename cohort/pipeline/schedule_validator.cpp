#include "cohort/pipeline/schedule_validator.h"

#include <algorithm>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

namespace cohort::pipeline {
namespace {

using Mark = std::pair<int, int>;

// What has happened to one (stage, micro-batch) so far.
struct Progress {
  bool f = false, b = false, i = false, w = false;
  bool sent_f = false, recv_f = false, sent_b = false, recv_b = false;
  bool backward() const { return b || i; }
};

class Checker {
 public:
  explicit Checker(const PipelineSchedule& s) : s_(s) {}

  void run() {
    check_shape();
    for (int r = 0; r < s_.num_ranks; ++r)
      for (int k = 0; k < static_cast<int>(s_.actions[r].size()); ++k) check_action(r, k);
    check_complete();
    dry_run();
  }

 private:
  [[noreturn]] void fail(const std::string& why, std::vector<Mark> marks = {}) const {
    std::ostringstream os;
    os << "validate_schedule: schedule " << s_.name << " (" << s_.num_ranks << " ranks, "
       << s_.num_stages << " stages, " << s_.num_microbatches << " micro-batches): " << why;
    if (!s_.actions.empty()) os << "\n" << format_grid(s_, marks);
    throw ScheduleError(os.str());
  }
  [[noreturn]] void fail_at(int r, int k, const std::string& why) const {
    fail("rank " + std::to_string(r) + " step " + std::to_string(k) + " (" +
             to_string(s_.actions[r][k]) + "): " + why,
         {{r, k}});
  }

  void check_shape() const {
    if (s_.num_ranks < 1 || s_.num_stages < 1 || s_.num_microbatches < 1)
      fail("ranks, stages and micro-batches must be positive");
    if (static_cast<int>(s_.actions.size()) != s_.num_ranks)
      fail("has action lists for " + std::to_string(s_.actions.size()) + " ranks");
    if (static_cast<int>(s_.stage_to_rank.size()) != s_.num_stages)
      fail("maps " + std::to_string(s_.stage_to_rank.size()) + " stages to ranks");
    std::vector<bool> has_stage(s_.num_ranks);
    for (int st = 0; st < s_.num_stages; ++st) {
      int r = s_.stage_to_rank[st];
      if (r < 0 || r >= s_.num_ranks)
        fail("stage " + std::to_string(st) + " maps to rank " + std::to_string(r) +
             ", outside [0, " + std::to_string(s_.num_ranks) + ")");
      has_stage[r] = true;
    }
    for (int r = 0; r < s_.num_ranks; ++r)
      if (!has_stage[r]) fail("rank " + std::to_string(r) + " holds no stage");
  }

  bool remote(int rank, int stage) const {
    return stage >= 0 && stage < s_.num_stages && s_.stage_to_rank[stage] != rank;
  }

  void check_action(int r, int k) {
    const Action& a = s_.actions[r][k];
    const int last = s_.num_stages - 1;
    if (a.stage < 0 || a.stage > last) fail_at(r, k, "no such stage");
    if (a.microbatch < 0 || a.microbatch >= s_.num_microbatches)
      fail_at(r, k, "no such micro-batch");
    if (s_.stage_to_rank[a.stage] != r)
      fail_at(r, k,
              "stage " + std::to_string(a.stage) + " belongs to rank " +
                  std::to_string(s_.stage_to_rank[a.stage]));
    Progress& p = at(a.stage, a.microbatch);
    const std::string mb = " of micro-batch " + std::to_string(a.microbatch);
    switch (a.type) {
      case ActionType::Forward:
        if (p.f) fail_at(r, k, "second forward" + mb);
        if (a.stage > 0 && !(remote(r, a.stage - 1) ? p.recv_f : at(a.stage - 1, a.microbatch).f))
          fail_at(r, k, "its input is not there yet (no RECV_F or earlier stage's F before it)");
        p.f = true;
        break;
      case ActionType::Backward:
      case ActionType::BackwardInput:
        if (!p.f) fail_at(r, k, "backward before forward" + mb);
        if (p.backward()) fail_at(r, k, "second backward" + mb);
        if (a.stage < last &&
            !(remote(r, a.stage + 1) ? p.recv_b : at(a.stage + 1, a.microbatch).backward()))
          fail_at(r, k,
                  "its output gradient is not there yet (no RECV_B or later stage's B/I "
                  "before it)");
        (a.type == ActionType::Backward ? p.b : p.i) = true;
        break;
      case ActionType::BackwardWeight:
        if (!p.i) fail_at(r, k, "W before I" + mb + (p.b ? " (it had a full B)" : ""));
        if (p.w) fail_at(r, k, "second W" + mb);
        p.w = true;
        break;
      case ActionType::SendForward:
        if (!remote(r, a.stage + 1)) fail_at(r, k, "the next stage is not on another rank");
        if (!p.f) fail_at(r, k, "send before the forward that produces it");
        if (p.sent_f) fail_at(r, k, "sent twice");
        p.sent_f = true;
        break;
      case ActionType::RecvForward:
        if (!remote(r, a.stage - 1)) fail_at(r, k, "the previous stage is not on another rank");
        if (p.recv_f) fail_at(r, k, "received twice");
        p.recv_f = true;
        break;
      case ActionType::SendBackward:
        if (!remote(r, a.stage - 1)) fail_at(r, k, "the previous stage is not on another rank");
        if (!p.backward()) fail_at(r, k, "send before the backward that produces it");
        if (p.sent_b) fail_at(r, k, "sent twice");
        p.sent_b = true;
        break;
      case ActionType::RecvBackward:
        if (!remote(r, a.stage + 1)) fail_at(r, k, "the next stage is not on another rank");
        if (p.recv_b) fail_at(r, k, "received twice");
        p.recv_b = true;
        break;
    }
  }

  void check_complete() {
    for (int st = 0; st < s_.num_stages; ++st) {
      const int r = s_.stage_to_rank[st];
      const Mark end{r, static_cast<int>(s_.actions[r].size())};
      for (int mb = 0; mb < s_.num_microbatches; ++mb) {
        const Progress& p = at(st, mb);
        auto missing = [&](const std::string& what) {
          fail("stage " + std::to_string(st) + " micro-batch " + std::to_string(mb) + " has no " +
                   what + " (rank " + std::to_string(r) + " ends, marked)",
               {end});
        };
        if (!p.f) missing("F");
        if (!p.backward()) missing("B or I");
        if (p.i && !p.w) missing("W after its I");
        if (remote(r, st + 1) && !p.sent_f) missing("SEND_F");
        if (remote(r, st - 1) && !p.sent_b) missing("SEND_B");
      }
    }
  }

  // Sends never block (the runtime posts them and waits at the end of the
  // step); a receive blocks until its send has run.
  void dry_run() const {
    std::set<std::tuple<ActionType, int, int>> sent;
    std::vector<size_t> pc(s_.num_ranks, 0);
    bool progress = true;
    while (progress) {
      progress = false;
      for (int r = 0; r < s_.num_ranks; ++r) {
        const auto& list = s_.actions[r];
        while (pc[r] < list.size()) {
          const Action& a = list[pc[r]];
          if (a.type == ActionType::RecvForward &&
              !sent.count({ActionType::SendForward, a.stage - 1, a.microbatch}))
            break;
          if (a.type == ActionType::RecvBackward &&
              !sent.count({ActionType::SendBackward, a.stage + 1, a.microbatch}))
            break;
          if (a.type == ActionType::SendForward || a.type == ActionType::SendBackward)
            sent.insert({a.type, a.stage, a.microbatch});
          ++pc[r];
          progress = true;
        }
      }
    }
    std::vector<Mark> blocked;
    std::string who;
    for (int r = 0; r < s_.num_ranks; ++r)
      if (pc[r] < s_.actions[r].size()) {
        blocked.push_back({r, static_cast<int>(pc[r])});
        who += (who.empty() ? "" : ", ") +
               ("rank " + std::to_string(r) + " waits at step " + std::to_string(pc[r]) + " (" +
                to_string(s_.actions[r][pc[r]]) + ")");
      }
    if (!blocked.empty()) fail("deadlock: " + who, blocked);
  }

  Progress& at(int stage, int mb) { return progress_[{stage, mb}]; }

  const PipelineSchedule& s_;
  std::map<std::pair<int, int>, Progress> progress_;
};

}  // namespace

std::string format_grid(const PipelineSchedule& s, const std::vector<Mark>& marks) {
  size_t rows = 0;
  for (const auto& list : s.actions) rows = std::max(rows, list.size() + 1);
  // Long schedules: the rows around the marks only.
  size_t lo = 0, hi = rows;
  if (rows > 60 && !marks.empty()) {
    int first = marks.front().second, lastm = marks.front().second;
    for (auto& m : marks) first = std::min(first, m.second), lastm = std::max(lastm, m.second);
    lo = static_cast<size_t>(std::max(0, first - 10));
    hi = std::min(rows, static_cast<size_t>(lastm) + 11);
  }
  std::ostringstream os;
  os << "step |";
  for (size_t r = 0; r < s.actions.size(); ++r)
    os << " rank " << std::left << std::setw(7) << r << "|";
  os << "\n";
  if (lo > 0) os << " ... |\n";
  for (size_t k = lo; k < hi; ++k) {
    os << std::right << std::setw(4) << k << " |";
    for (size_t r = 0; r < s.actions.size(); ++r) {
      std::string cell = k < s.actions[r].size()    ? to_string(s.actions[r][k])
                         : k == s.actions[r].size() ? "(end)"
                                                    : "";
      for (auto& m : marks)
        if (m.first == static_cast<int>(r) && m.second == static_cast<int>(k)) cell += " <<";
      os << ' ' << std::left << std::setw(12) << cell << "|";
    }
    os << "\n";
  }
  if (hi < rows) os << " ... |\n";
  return os.str();
}

void validate_schedule(const PipelineSchedule& schedule) {
  if (has_communication(schedule) || schedule.actions.empty()) {
    Checker(schedule).run();
    return;
  }
  // Check shape first so add_communication never reads outside the map.
  bool shape_ok = static_cast<int>(schedule.stage_to_rank.size()) == schedule.num_stages;
  for (int r : schedule.stage_to_rank) shape_ok = shape_ok && r >= 0 && r < schedule.num_ranks;
  if (!shape_ok) {
    Checker(schedule).run();
    return;
  }
  Checker(add_communication(schedule)).run();
}

}  // namespace cohort::pipeline
