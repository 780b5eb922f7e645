// Schedules as data: text form, generators, validator grid and broken
// schedules, simulator closed forms. No model runs here.
#include "cohort/pipeline/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "cohort/pipeline/schedule_simulator.h"
#include "cohort/pipeline/schedule_validator.h"

namespace cohort::pipeline::schedule_test {
namespace {

std::string error_of(const PipelineSchedule& s) {
  try {
    validate_schedule(s);
  } catch (const ScheduleError& e) {
    return e.what();
  }
  return "";
}

TEST(PipelineSchedule, ActionTextRoundTrips) {
  for (const char* tok :
       {"2F0", "1W3", "0B12", "3I1", "0SEND_F1", "1RECV_F1", "1SEND_B0", "0RECV_B7"})
    EXPECT_EQ(to_string(parse_action(tok)), tok);
  Action a = parse_action("2F0");
  EXPECT_EQ(a.stage, 2);
  EXPECT_EQ(a.type, ActionType::Forward);
  EXPECT_EQ(a.microbatch, 0);
  for (const char* bad : {"", "F0", "2F", "2X0", "2SEND0", "x2F0"})
    EXPECT_THROW(parse_action(bad), InvalidArgument) << bad;
}

TEST(PipelineSchedule, ScheduleTextRoundTrips) {
  for (const char* name : {"gpipe", "1f1b", "interleaved", "zbh1"}) {
    auto s = add_communication(make_schedule(name, 2, 2, 4));
    auto back = parse_schedule(format_schedule(s));
    EXPECT_EQ(format_schedule(back), format_schedule(s));
    EXPECT_EQ(back.actions, s.actions);
    EXPECT_EQ(back.stage_to_rank, s.stage_to_rank);
    EXPECT_NO_THROW(validate_schedule(back));
  }
  EXPECT_THROW(parse_schedule("schedule x stages 2 microbatches 1 map 0\n"), InvalidArgument);
  EXPECT_THROW(parse_schedule("schedule x stages 1 microbatches 1 map 0\nrank 1: 0F0\n"),
               InvalidArgument);
}

TEST(PipelineSchedule, OneFOneBHasMegatronWarmup) {
  auto s = Schedule1F1B(3, 4);
  EXPECT_EQ(s.actions[0].front(), (Action{0, ActionType::Forward, 0}));
  // Rank 0 runs pp - 1 = 2 forwards before the first 1F1B pair.
  EXPECT_EQ(to_string(s.actions[0][2]), "0F2");
  EXPECT_EQ(to_string(s.actions[0][3]), "0B0");
  EXPECT_EQ(to_string(s.actions[2][1]), "2B0");
}

TEST(PipelineSchedule, InterleavedPlacesStageRankPlusKpp) {
  auto s = ScheduleInterleaved1F1B(2, 2, 4);
  EXPECT_EQ(s.num_stages, 4);
  EXPECT_EQ(s.stage_to_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(s.stages_of(1), (std::vector<int>{1, 3}));
  // Megatron: the first pp micro-batches through chunk 0, then chunk 1.
  EXPECT_EQ(to_string(s.actions[0][0]), "0F0");
  EXPECT_EQ(to_string(s.actions[0][1]), "0F1");
  EXPECT_EQ(to_string(s.actions[0][2]), "2F0");
  EXPECT_THROW(ScheduleInterleaved1F1B(2, 2, 3), InvalidArgument);
  EXPECT_THROW(ScheduleGPipe(2, 0), InvalidArgument);
  EXPECT_THROW(make_schedule("pipedream", 2, 1, 2), InvalidArgument);
}

// Every generator, odd pp and m not divisible by pp where allowed.
TEST(PipelineValidator, GeneratorsPassOverGrid) {
  for (int pp : {1, 2, 3, 4, 5})
    for (int m : {1, 2, 3, 5, 7, 8}) {
      for (const char* name : {"gpipe", "1f1b", "zbh1"}) {
        auto s = make_schedule(name, pp, 1, m);
        EXPECT_NO_THROW(validate_schedule(s)) << name << " pp " << pp << " m " << m;
        EXPECT_NO_THROW(validate_schedule(add_communication(s)));
      }
      for (int v : {1, 2, 3})
        if (m % pp == 0)
          EXPECT_NO_THROW(validate_schedule(ScheduleInterleaved1F1B(pp, v, m)))
              << "interleaved pp " << pp << " v " << v << " m " << m;
        else
          EXPECT_THROW(ScheduleInterleaved1F1B(pp, v, m), InvalidArgument);
    }
}

TEST(PipelineValidator, RefusesMissingW) {
  auto s = add_communication(ScheduleZBH1(2, 3));
  auto& list = s.actions[1];
  list.erase(std::find(list.begin(), list.end(), parse_action("1W2")));
  std::string e = error_of(s);
  EXPECT_NE(e.find("stage 1 micro-batch 2 has no W"), std::string::npos) << e;
  EXPECT_NE(e.find("(end) <<"), std::string::npos) << e;
}

TEST(PipelineValidator, RefusesSendBeforeItsForward) {
  auto s = add_communication(Schedule1F1B(2, 2));
  auto& list = s.actions[0];
  // 0F0 0SEND_F0 -> 0SEND_F0 0F0
  ASSERT_EQ(to_string(list[0]), "0F0");
  std::swap(list[0], list[1]);
  std::string e = error_of(s);
  EXPECT_NE(e.find("rank 0 step 0 (0SEND_F0): send before the forward"), std::string::npos) << e;
  EXPECT_NE(e.find("0SEND_F0 <<"), std::string::npos) << e;
}

TEST(PipelineValidator, RefusesSendToTheWrongMicrobatch) {
  auto s = add_communication(Schedule1F1B(2, 2));
  for (auto& a : s.actions[0])
    if (a.type == ActionType::SendForward) a.microbatch = 1 - a.microbatch;
  std::string e = error_of(s);
  EXPECT_NE(e.find("send before the forward"), std::string::npos) << e;
}

TEST(PipelineValidator, RefusesDeadlockAndMarksBlockedSteps) {
  // Rank 0 waits for a gradient before it sends the activation that the
  // gradient needs.
  auto s = parse_schedule(
      "schedule dead stages 2 microbatches 1 map 0 1\n"
      "rank 0: 0F0 0RECV_B0 0B0 0SEND_F0\n"
      "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0\n");
  std::string e = error_of(s);
  EXPECT_NE(e.find("deadlock: rank 0 waits at step 1 (0RECV_B0), rank 1 waits at step 0 "
                   "(1RECV_F0)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("0RECV_B0 <<"), std::string::npos) << e;
  EXPECT_NE(e.find("1RECV_F0 <<"), std::string::npos) << e;
}

TEST(PipelineValidator, RefusesMalformed) {
  auto s = Schedule1F1B(2, 2);
  s.stage_to_rank = {0, 0};
  EXPECT_NE(error_of(s).find("rank 1 holds no stage"), std::string::npos);
  s = add_communication(Schedule1F1B(2, 2));
  s.actions[1].push_back(parse_action("1F0"));
  EXPECT_NE(error_of(s).find("second forward"), std::string::npos);
  s = Schedule1F1B(2, 2);
  s.actions[0].insert(s.actions[0].begin(), parse_action("1F0"));
  EXPECT_NE(error_of(s).find("stage 1 belongs to rank 1"), std::string::npos);
  s = ScheduleZBH1(2, 2);
  auto& list = s.actions[1];
  std::iter_swap(std::find(list.begin(), list.end(), parse_action("1I0")),
                 std::find(list.begin(), list.end(), parse_action("1W0")));
  EXPECT_NE(error_of(s).find("W before I"), std::string::npos) << error_of(s);
}

// Equal costs, free transfers: Megatron's closed forms.
TEST(PipelineSimulator, ClosedForms) {
  SimulatorCosts c;  // F 1, B 2, I 1, W 1
  for (int pp : {1, 2, 3, 4})
    for (int m : {1, 2, 4, 5, 8}) {
      for (const char* name : {"gpipe", "1f1b"}) {
        auto r = simulate_schedule(make_schedule(name, pp, 1, m), c);
        EXPECT_DOUBLE_EQ(r.step_ms, (m + pp - 1) * 3.0) << name << pp << " " << m;
        EXPECT_NEAR(r.bubble_ratio, double(pp - 1) / m, 1e-12);
        EXPECT_NEAR(r.bubble_fraction, double(pp - 1) / (m + pp - 1), 1e-12);
      }
      for (int v : {2, 3})
        if (m % pp == 0) {
          auto r = simulate_schedule(ScheduleInterleaved1F1B(pp, v, m), c);
          EXPECT_NEAR(r.bubble_ratio, double(pp - 1) / (v * m), 1e-12)
              << "interleaved pp " << pp << " v " << v << " m " << m;
        }
      // ZB-H1 (m >= pp, as in the paper): the paper's bubble,
      // (pp - 1)(F + I - W), within 1F1B's peak of pp micro-batches,
      // against 1F1B's (pp - 1)(F + B).
      if (m < pp) continue;
      auto zb = simulate_schedule(ScheduleZBH1(pp, m), c);
      auto one = simulate_schedule(Schedule1F1B(pp, m), c);
      EXPECT_DOUBLE_EQ(zb.step_ms - 3.0 * m, (pp - 1) * (1.0 + 1.0 - 1.0))
          << "zbh1 pp " << pp << " m " << m;
      EXPECT_LE(
          *std::max_element(zb.peak_live_microbatches.begin(), zb.peak_live_microbatches.end()),
          pp);
      EXPECT_DOUBLE_EQ(one.step_ms - 3.0 * m, (pp - 1) * 3.0);
    }
}

TEST(PipelineSimulator, TransfersAddLatency) {
  SimulatorCosts c;
  c.boundary_bytes = {1000};
  c.transfer_ms = [](int64_t bytes) { return 0.5 + bytes * 1e-3; };  // 1.5 ms
  // GPipe, pp 2, m 1: F, transfer, F, B, transfer, B.
  auto r = simulate_schedule(ScheduleGPipe(2, 1), c);
  EXPECT_DOUBLE_EQ(r.step_ms, 1 + 1.5 + 1 + 2 + 1.5 + 2);
}

// One sample per type, equal to the mean: the deterministic simulator.
TEST(PipelineSimulator, MonteCarloWithoutVarianceIsDeterministic) {
  SimulatorCosts c;
  c.stages = {StageCosts{1.5, 2.5, 1.25, 1.0}, StageCosts{1.0, 2.0, 0.75, 1.5}};
  c.boundary_bytes = {100};
  c.transfer_ms = [](int64_t) { return 0.25; };
  std::vector<StageCostSamples> samples;
  for (const auto& sc : c.stages)
    samples.push_back(
        {{sc.forward_ms}, {sc.backward_ms}, {sc.backward_input_ms}, {sc.backward_weight_ms}});
  for (const char* name : {"gpipe", "1f1b", "zbh1"})
    for (int m : {1, 2, 5}) {
      auto det = simulate_schedule(make_schedule(name, 2, 1, m), c);
      auto mc = simulate_schedule_monte_carlo(make_schedule(name, 2, 1, m), c, samples, 7);
      EXPECT_DOUBLE_EQ(mc.mean_step_ms, det.step_ms) << name << " m " << m;
      EXPECT_NEAR(mc.mean_bubble_fraction, det.bubble_fraction, 1e-12);
      EXPECT_DOUBLE_EQ(mc.p10_step_ms, det.step_ms);
      EXPECT_DOUBLE_EQ(mc.p90_step_ms, det.step_ms);
      EXPECT_EQ(mc.draws, 7);
    }
}

// GPipe, pp 2, m 2, free transfers, free backwards; stage 1's F costs 2,
// stage 0's F a or b, each 1 or 3 with equal odds. Stage 1 starts micro-batch
// 1 at a + max(2, b), so the step is a + max(2, b) + 2: 5, 6, 7 or 8 with
// equal odds, mean 6.5, where the mean costs (F 2 everywhere) give 6.
TEST(PipelineSimulator, MonteCarloTwoStageClosedForm) {
  SimulatorCosts c;
  c.stages = {StageCosts{2, 0, 0, 0}, StageCosts{2, 0, 0, 0}};
  std::vector<StageCostSamples> samples{{{1, 3}, {0}, {}, {}}, {{2}, {0}, {}, {}}};
  auto schedule = ScheduleGPipe(2, 2);
  EXPECT_DOUBLE_EQ(simulate_schedule(schedule, c).step_ms, 6.0);
  auto mc = simulate_schedule_monte_carlo(schedule, c, samples, 20000, 3);
  EXPECT_NEAR(mc.mean_step_ms, 6.5, 0.05);
  EXPECT_DOUBLE_EQ(mc.p10_step_ms, 5.0);
  EXPECT_DOUBLE_EQ(mc.p90_step_ms, 8.0);
  // Per draw: 1 - (a + b) / step and 1 - 4 / step averaged over the ranks;
  // over the four cases 0.4, 1/3, 3/7, 0.375.
  EXPECT_NEAR(mc.mean_bubble_fraction, (0.4 + 1.0 / 3 + 3.0 / 7 + 0.375) / 4, 0.01);
}

TEST(PipelineSimulator, MonteCarloRefusesBadInput) {
  SimulatorCosts c;
  std::vector<StageCostSamples> one{{{1}, {2}, {1}, {1}}};
  EXPECT_THROW(simulate_schedule_monte_carlo(Schedule1F1B(2, 2), c, one, 0), InvalidArgument);
  std::vector<StageCostSamples> three(3, one[0]);
  EXPECT_THROW(simulate_schedule_monte_carlo(Schedule1F1B(2, 2), c, three, 5), InvalidArgument);
  EXPECT_THROW(simulate_schedule_monte_carlo(Schedule1F1B(2, 2), c, {}, 5), InvalidArgument);
}

}  // namespace
}  // namespace cohort::pipeline::schedule_test
