#include "cohort/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <limits>
#include <sstream>

#include "cohort/core/error.h"

namespace cohort::pipeline {
namespace {

struct TypeName {
  ActionType type;
  const char* text;
};
// Longest first, so that parsing never takes a prefix of another name.
constexpr TypeName kTypeNames[] = {
    {ActionType::SendForward, "SEND_F"},  {ActionType::RecvForward, "RECV_F"},
    {ActionType::SendBackward, "SEND_B"}, {ActionType::RecvBackward, "RECV_B"},
    {ActionType::Forward, "F"},           {ActionType::Backward, "B"},
    {ActionType::BackwardInput, "I"},     {ActionType::BackwardWeight, "W"},
};

void check_sizes(const char* name, int pp, int v, int m) {
  if (pp < 1 || v < 1 || m < 1) {
    std::ostringstream os;
    os << name << ": pp, v and the number of micro-batches must be positive (pp " << pp << ", v "
       << v << ", m " << m << ")";
    throw InvalidArgument(os.str());
  }
}

PipelineSchedule empty_schedule(const char* name, int pp, int v, int m) {
  check_sizes(name, pp, v, m);
  PipelineSchedule s;
  s.name = name;
  s.num_ranks = pp;
  s.num_stages = pp * v;
  s.num_microbatches = m;
  s.stage_to_rank = loop_stage_to_rank(pp, v);
  s.actions.resize(pp);
  return s;
}

// One rank of 1F1B: pp - rank - 1 forwards of warm-up, then one forward
// and one backward, then the remaining backwards.
std::vector<Action> one_f_one_b(int pp, int rank, int m) {
  std::vector<Action> out;
  const int warmup = std::min(pp - rank - 1, m);
  for (int i = 0; i < warmup; ++i) out.push_back({rank, ActionType::Forward, i});
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back({rank, ActionType::Forward, warmup + i});
    out.push_back({rank, ActionType::Backward, i});
  }
  for (int i = m - warmup; i < m; ++i) out.push_back({rank, ActionType::Backward, i});
  return out;
}

// ZB-H1 as a list schedule on unit costs (F = I = W = 1, free transfers):
// at each time step a free rank runs the first of
//   F  when its input is there, fewer than pp - rank micro-batches wait for
//      I (1F1B's warm-up) and fewer than pp hold activations (a micro-batch
//      holds them until its W: the peak stays 1F1B's, pp micro-batches),
//   I  when the next stage's input gradient is there,
//   W  of the oldest micro-batch whose I ran (it fills what would be idle,
//      and frees a slot once the bound holds F back).
// With m >= pp the bubble is the paper's (pp - 1)(F + I - W). Running the
// bound's W before a ready I instead costs one W more (the I is on the
// critical path; the W is not).
std::vector<std::vector<Action>> zero_bubble_h1(int pp, int m) {
  constexpr int kNotYet = std::numeric_limits<int>::max();
  std::vector<std::vector<int>> f_end(pp, std::vector<int>(m, kNotYet)), i_end = f_end;
  std::vector<int> next_f(pp, 0), next_i(pp, 0), free_at(pp, 0), w_done(pp, 0);
  std::vector<std::deque<int>> pending_w(pp);
  std::vector<std::vector<Action>> out(pp);
  size_t done = 0, total = static_cast<size_t>(3) * pp * m;
  for (int t = 0; done < total; ++t) {
    for (int r = 0; r < pp; ++r) {
      if (free_at[r] > t) continue;
      const int f = next_f[r], i = next_i[r];
      const bool full = f - w_done[r] >= pp;  // pp micro-batches hold activations
      if (f < m && (r == 0 || f_end[r - 1][f] <= t) && f - i < pp - r && !full) {
        out[r].push_back({r, ActionType::Forward, f});
        f_end[r][f] = t + 1;
        ++next_f[r];
      } else if (i < f && f_end[r][i] <= t && (r == pp - 1 || i_end[r + 1][i] <= t)) {
        out[r].push_back({r, ActionType::BackwardInput, i});
        i_end[r][i] = t + 1;
        pending_w[r].push_back(i);
        ++next_i[r];
      } else if (!pending_w[r].empty()) {
        out[r].push_back({r, ActionType::BackwardWeight, pending_w[r].front()});
        pending_w[r].pop_front();
        ++w_done[r];
      } else {
        continue;
      }
      free_at[r] = t + 1;
      ++done;
    }
  }
  return out;
}

}  // namespace

bool is_compute(ActionType type) {
  return type == ActionType::Forward || type == ActionType::Backward ||
         type == ActionType::BackwardInput || type == ActionType::BackwardWeight;
}

const char* action_type_name(ActionType type) {
  for (const auto& tn : kTypeNames)
    if (tn.type == type) return tn.text;
  COHORT_CHECK(false, "unknown action type");
  return "?";
}

std::string to_string(const Action& a) {
  return std::to_string(a.stage) + action_type_name(a.type) + std::to_string(a.microbatch);
}

Action parse_action(const std::string& token) {
  size_t i = 0;
  while (i < token.size() && std::isdigit(static_cast<unsigned char>(token[i]))) ++i;
  size_t j = token.size();
  while (j > i && std::isdigit(static_cast<unsigned char>(token[j - 1]))) --j;
  const std::string kind = token.substr(i, j - i);
  if (i == 0 || j == token.size() || i > 9 || token.size() - j > 9)
    throw InvalidArgument("parse_action: '" + token +
                          "' is not <stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B><micro-batch>");
  for (const auto& tn : kTypeNames)
    if (kind == tn.text)
      return {std::stoi(token.substr(0, i)), tn.type, std::stoi(token.substr(j))};
  throw InvalidArgument("parse_action: '" + token + "' has unknown action '" + kind +
                        "' (F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B)");
}

std::vector<int> PipelineSchedule::stages_of(int rank) const {
  std::vector<int> out;
  for (int s = 0; s < static_cast<int>(stage_to_rank.size()); ++s)
    if (stage_to_rank[s] == rank) out.push_back(s);
  return out;
}

std::string format_schedule(const PipelineSchedule& s) {
  std::ostringstream os;
  os << "schedule " << (s.name.empty() ? "custom" : s.name) << " stages " << s.num_stages
     << " microbatches " << s.num_microbatches << " map";
  for (int r : s.stage_to_rank) os << ' ' << r;
  os << '\n';
  for (size_t r = 0; r < s.actions.size(); ++r) {
    os << "rank " << r << ':';
    for (const auto& a : s.actions[r]) os << ' ' << to_string(a);
    os << '\n';
  }
  return os.str();
}

PipelineSchedule parse_schedule(const std::string& text) {
  std::istringstream in(text);
  std::string line, word;
  PipelineSchedule s;
  auto bad = [](const std::string& why) { throw InvalidArgument("parse_schedule: " + why); };
  if (!std::getline(in, line)) bad("empty text");
  {
    std::istringstream h(line);
    std::string k1, k2, k3, k4;
    if (!(h >> k1 >> s.name >> k2 >> s.num_stages >> k3 >> s.num_microbatches >> k4) ||
        k1 != "schedule" || k2 != "stages" || k3 != "microbatches" || k4 != "map")
      bad("header must be 'schedule NAME stages S microbatches M map r0 r1 ...', got '" + line +
          "'");
    int r;
    while (h >> r) s.stage_to_rank.push_back(r);
  }
  if (static_cast<int>(s.stage_to_rank.size()) != s.num_stages)
    bad("the map names " + std::to_string(s.stage_to_rank.size()) + " stages, the header " +
        std::to_string(s.num_stages));
  while (std::getline(in, line)) {
    std::istringstream l(line);
    std::string rank_word, rank_text;
    if (!(l >> rank_word)) continue;  // blank line
    if (!(l >> rank_text) || rank_word != "rank" || rank_text.back() != ':' ||
        rank_text != std::to_string(s.actions.size()) + ":")
      bad("expected 'rank " + std::to_string(s.actions.size()) + ": ...', got '" + line + "'");
    s.actions.emplace_back();
    while (l >> word) s.actions.back().push_back(parse_action(word));
  }
  s.num_ranks = static_cast<int>(s.actions.size());
  return s;
}

std::vector<int> loop_stage_to_rank(int pp, int v) {
  std::vector<int> map(pp * v);
  for (int s = 0; s < pp * v; ++s) map[s] = s % pp;
  return map;
}

PipelineSchedule ScheduleGPipe(int pp, int m) {
  auto s = empty_schedule("GPipe", pp, 1, m);
  for (int r = 0; r < pp; ++r) {
    for (int i = 0; i < m; ++i) s.actions[r].push_back({r, ActionType::Forward, i});
    for (int i = 0; i < m; ++i) s.actions[r].push_back({r, ActionType::Backward, i});
  }
  return s;
}

PipelineSchedule Schedule1F1B(int pp, int m) {
  auto s = empty_schedule("1F1B", pp, 1, m);
  for (int r = 0; r < pp; ++r) s.actions[r] = one_f_one_b(pp, r, m);
  return s;
}

PipelineSchedule ScheduleZBH1(int pp, int m) {
  auto s = empty_schedule("ZBH1", pp, 1, m);
  s.actions = zero_bubble_h1(pp, m);
  return s;
}

PipelineSchedule ScheduleInterleaved1F1B(int pp, int v, int m) {
  auto s = empty_schedule("Interleaved1F1B", pp, v, m);
  if (m % pp != 0)
    throw InvalidArgument("ScheduleInterleaved1F1B: the number of micro-batches (" +
                          std::to_string(m) + ") must be a multiple of pp (" + std::to_string(pp) +
                          ")");
  const int total = m * v;
  // Megatron's order: micro-batches in groups of pp, each group through
  // chunk 0, then chunk 1, ...; backwards through the chunks in reverse.
  auto stage_of = [&](int rank, int k, bool forward) {
    int chunk = (k % (pp * v)) / pp;
    if (!forward) chunk = v - 1 - chunk;
    return chunk * pp + rank;
  };
  auto mb_of = [&](int k) { return (k / (pp * v)) * pp + k % pp; };
  for (int r = 0; r < pp; ++r) {
    int warmup = m == pp ? total : std::min((pp - r - 1) * 2 + (v - 1) * pp, total);
    auto& out = s.actions[r];
    for (int k = 0; k < warmup; ++k)
      out.push_back({stage_of(r, k, true), ActionType::Forward, mb_of(k)});
    for (int k = 0; k < total - warmup; ++k) {
      int f = k + warmup;
      out.push_back({stage_of(r, f, true), ActionType::Forward, mb_of(f)});
      out.push_back({stage_of(r, k, false), ActionType::Backward, mb_of(k)});
    }
    for (int k = total - warmup; k < total; ++k)
      out.push_back({stage_of(r, k, false), ActionType::Backward, mb_of(k)});
  }
  return s;
}

PipelineSchedule make_schedule(const std::string& name, int pp, int v, int m) {
  if (name == "gpipe") return ScheduleGPipe(pp, m);
  if (name == "1f1b") return Schedule1F1B(pp, m);
  if (name == "interleaved") return ScheduleInterleaved1F1B(pp, v, m);
  if (name == "zbh1") return ScheduleZBH1(pp, m);
  throw InvalidArgument("make_schedule: unknown schedule '" + name +
                        "' (gpipe, 1f1b, interleaved, zbh1)");
}

bool has_communication(const PipelineSchedule& s) {
  for (const auto& list : s.actions)
    for (const auto& a : list)
      if (!is_compute(a.type)) return true;
  return false;
}

PipelineSchedule add_communication(const PipelineSchedule& in) {
  PipelineSchedule out = in;
  const int last = in.num_stages - 1;
  auto remote = [&](int rank, int stage) {
    return stage >= 0 && stage <= last && in.stage_to_rank.at(stage) != rank;
  };
  for (int r = 0; r < static_cast<int>(in.actions.size()); ++r) {
    auto& list = out.actions[r];
    list.clear();
    for (const Action& a : in.actions[r]) {
      if (!is_compute(a.type))
        throw InvalidArgument("add_communication: schedule " + in.name +
                              " already has communication (" + to_string(a) + " on rank " +
                              std::to_string(r) + ")");
      const bool fwd = a.type == ActionType::Forward;
      const bool bwd = a.type == ActionType::Backward || a.type == ActionType::BackwardInput;
      if (fwd && remote(r, a.stage - 1))
        list.push_back({a.stage, ActionType::RecvForward, a.microbatch});
      if (bwd && remote(r, a.stage + 1))
        list.push_back({a.stage, ActionType::RecvBackward, a.microbatch});
      list.push_back(a);
      if (fwd && remote(r, a.stage + 1))
        list.push_back({a.stage, ActionType::SendForward, a.microbatch});
      if (bwd && remote(r, a.stage - 1))
        list.push_back({a.stage, ActionType::SendBackward, a.microbatch});
    }
  }
  return out;
}

}  // namespace cohort::pipeline
