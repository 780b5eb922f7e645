// The timeline (COHORT_TRACE): a traced DDP job through the Trainer writes one
// file per rank that parses, whose complete events nest per thread, in which
// every collective appears on every rank, and whose totals equal the
// communicator's counters; merging gives one lane per rank with the clocks
// aligned; the fused optimizer's steps are traced; a pipeline step records
// each schedule action once; a capped trace stays valid and counts what it
// dropped; tracing off writes nothing; cohortrun --trace runs the whole path
// across processes.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/observability/counting_engine.h"
#include "cohort/optim/trainer_adapters.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "tests/pipeline/pipeline_test_models.h"
#include "tests/train/train_fixtures.h"
#include "trace_files.h"
#include "trace_summary.h"

namespace cohort::trace_test {
namespace {

using nlohmann::json;

json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);  // throws (fails the test) if it does not parse
}

// Three DDP steps through the Trainer on `world` thread ranks, traced into
// `dir`; returns each rank's counters at the end.
std::vector<CommStats> traced_ddp_run(int world, const std::string& dir) {
  std::vector<CommStats> stats(static_cast<size_t>(world));
  const auto data = testing::make_data(64);
  testing::ThreadRanksOptions options;
  options.trace_dir = dir;
  testing::run_ranks_shared(
      world,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        ASSERT_NE(comm->tracer(), nullptr);
        auto net = testing::make_mlp();
        DDPOptions ddp_options;
        ddp_options.first_bucket_mb = 0.0005;  // several buckets for this small model
        ddp_options.bucket_cap_mb = 0.0005;
        DistributedDataParallel<torch::nn::Sequential> ddp(net, comm, ddp_options);
        torch::optim::SGD sgd(ddp.parameters(), 0.1);
        TrainerOptions config;
        config.progress = false;
        LossFn loss = [&](const torch::data::Example<>& b) {
          return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
        };
        Trainer trainer(TrainerWiring::ddp(ddp, sgd), loss, config);
        for (int64_t s = 0; s < 3; ++s) {
          const int64_t start = (s * world + comm->rank()) * 4;
          trainer.train_step({{data.x.narrow(0, start, 4), data.y.narrow(0, start, 4)}});
        }
        stats[static_cast<size_t>(comm->rank())] = comm->stats();
      },
      options);
  return stats;  // the communicators are gone: every file is written
}

// Complete events of each thread form a forest: a later event starts after
// the open one ended, or ends within it.
void expect_nested(const json& events, int rank) {
  std::map<int, std::vector<std::pair<double, double>>> by_thread;
  for (const auto& e : events) {
    if (e["ph"] != "X") continue;
    const double ts = e["ts"].get<double>();
    by_thread[e["tid"].get<int>()].emplace_back(ts, ts + e["dur"].get<double>());
  }
  constexpr double kEps = 1e-3;  // printed with nanosecond digits
  for (auto& [tid, spans] : by_thread) {
    std::sort(spans.begin(), spans.end(), [](const auto& a, const auto& b) {
      return a.first != b.first ? a.first < b.first : a.second > b.second;
    });
    std::vector<std::pair<double, double>> open;
    for (const auto& s : spans) {
      while (!open.empty() && open.back().second <= s.first + kEps) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(s.second, open.back().second + kEps)
            << "rank " << rank << " thread " << tid << ": [" << s.first << ", " << s.second
            << "] overlaps [" << open.back().first << ", " << open.back().second << "]";
      }
      open.push_back(s);
    }
  }
}

class TraceDdp : public ::testing::TestWithParam<int> {};

TEST_P(TraceDdp, ParsesNestsAppearsOnEveryRankAndMatchesTheCounters) {
  const int world = GetParam();
  testing::TempDir dir("cohort-trace");
  const auto stats = traced_ddp_run(world, dir.str());

  std::set<std::tuple<std::string, std::string, int64_t>> collectives_of_rank0;
  for (int r = 0; r < world; ++r) {
    const json doc = read_json(dir / ("rank-" + std::to_string(r) + ".json"));
    const json& events = doc.at("traceEvents");
    EXPECT_EQ(doc["otherData"]["rank"], r);
    expect_nested(events, r);

    // Totals per operation kind, as the counters keep them.
    std::map<std::string, int64_t> issued, completed;
    std::map<std::string, double> flight_s, wait_s;
    std::map<int64_t, double> flight_begin;
    std::set<std::tuple<std::string, std::string, int64_t>> collectives;
    std::set<std::string> phases;
    for (const auto& e : events) {
      const std::string cat = e.value("cat", "");
      const std::string name = e.value("name", "");
      if (cat == "train" || cat == "ddp") phases.insert(name);
      if (cat == "comm") {
        ++issued[to_string(op_kind_from_name(name))];
        collectives.emplace(e["args"]["group"], name, e["args"]["seq"].get<int64_t>());
      } else if (cat == "comm.wait") {
        wait_s[name.substr(5)] += e["dur"].get<double>() / 1e6;  // "wait <op>"
      } else if (cat == "comm.flight" && e["ph"] == "b") {
        ++completed[name];
        flight_begin[e["id"].get<int64_t>()] = e["ts"].get<double>();
      } else if (cat == "comm.flight" && e["ph"] == "e") {
        flight_s[name] += (e["ts"].get<double>() - flight_begin.at(e["id"].get<int64_t>())) / 1e6;
      }
    }
    for (const char* phase : {"train step", "forward", "backward", "optimizer"}) {
      EXPECT_TRUE(phases.count(phase)) << "rank " << r << " has no '" << phase << "' event";
    }
    if (world > 1) {
      EXPECT_TRUE(phases.count("bucket ready")) << "rank " << r;
      EXPECT_TRUE(phases.count("launch bucket")) << "rank " << r;
    }
    const auto& st = stats[static_cast<size_t>(r)];
    int64_t calls = 0;
    for (size_t k = 0; k < kOpKindCount; ++k) {
      const auto kind = static_cast<OpKind>(k);
      const std::string n = to_string(kind);
      calls += static_cast<int64_t>(st[kind].calls);
      EXPECT_EQ(issued[n], static_cast<int64_t>(st[kind].calls)) << "rank " << r << " " << n;
      EXPECT_EQ(completed[n], static_cast<int64_t>(st[kind].completed)) << "rank " << r << " " << n;
      EXPECT_NEAR(flight_s[n], st[kind].seconds_in_flight, 1e-6) << "rank " << r << " " << n;
      EXPECT_NEAR(wait_s[n], st[kind].seconds_waiting, 1e-6) << "rank " << r << " " << n;
    }
    EXPECT_GT(calls, 3 * 1);  // the Trainer's loss all-reduce each step, at least
    if (r == 0) {
      collectives_of_rank0 = collectives;
    } else {
      EXPECT_EQ(collectives, collectives_of_rank0) << "rank " << r << " vs rank 0";
    }
  }

  // One lane per rank; in one process the clocks are one clock, so the
  // measured offset is within half the round trip it was measured with.
  const auto ranks = cohort_trace::read_rank_traces(dir.str());
  ASSERT_EQ(static_cast<int>(ranks.size()), world);
  const json merged = cohort_trace::merge_traces(ranks);
  std::set<int> lanes;
  for (const auto& e : merged["traceEvents"]) lanes.insert(e["pid"].get<int>());
  EXPECT_EQ(static_cast<int>(lanes.size()), world);
  for (int r = 1; r < world; ++r) {
    const json doc = read_json(dir / ("rank-" + std::to_string(r) + ".json"));
    const double offset = doc["otherData"]["clock_offset_us"];
    const double rtt = doc["otherData"]["clock_round_trip_us"];
    EXPECT_GT(rtt, 0.0);
    EXPECT_LE(std::abs(offset), rtt / 2 + 1.0) << "rank " << r;
  }

  const auto summary = cohort_trace::summarize_trace(merged);
  ASSERT_EQ(static_cast<int>(summary.size()), world);
  for (const auto& s : summary) {
    EXPECT_GT(s.wall_s, 0.0);
    EXPECT_GT(s.busy_s, 0.0);
    EXPECT_NEAR(s.busy_s + s.comm_s + s.idle_s, s.wall_s, 1e-9 + 1e-9 * s.wall_s);
    EXPECT_EQ(s.operations, static_cast<int64_t>(stats[static_cast<size_t>(s.rank)].total().calls));
    EXPECT_LE(s.slowest.size(), 5u);
  }
  EXPECT_NE(cohort_trace::format_summary(summary).find("slowest"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(World, TraceDdp, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(Trace, FusedOptimizerStepsAreTraced) {
  testing::TempDir dir("cohort-trace");
  testing::ThreadRanksOptions options;
  options.trace_dir = dir.str();
  testing::run_ranks_shared(
      2,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        auto net = testing::make_mlp();
        FusedDistributedOptimizer fused(net->parameters(), comm, torch::optim::AdamWOptions(1e-2));
        for (int s = 0; s < 2; ++s) {
          auto x = torch::full({4, 8}, 0.1 * (comm->rank() + 1));
          net->forward(x).sum().backward();
          fused.step();
        }
      },
      options);
  for (int r = 0; r < 2; ++r) {
    const json doc = read_json(dir / ("rank-" + std::to_string(r) + ".json"));
    int steps = 0;
    for (const auto& e : doc["traceEvents"]) {
      if (e.value("name", "") == "fused optimizer step") ++steps;
    }
    EXPECT_EQ(steps, 2) << "rank " << r;
    expect_nested(doc["traceEvents"], r);
  }
}

// pp = 2, 1F1B, m = 4: each rank's trace holds every action of its part of
// the schedule exactly once (name, stage, micro-batch), inside the step's
// span, and the summary splits the step into compute and communication.
TEST(Trace, PipelineActionsAppearOncePerRank) {
  constexpr int kPP = 2, kM = 4;
  testing::TempDir dir("cohort-trace");
  testing::ThreadRanksOptions options;
  options.trace_dir = dir.str();
  std::vector<std::vector<pipeline::Action>> actions(kPP);
  const auto x = pipeline::testing::det({8, pipeline::testing::kWidth}, 0.3);
  const auto y = pipeline::testing::det({8, pipeline::testing::kWidth}, 1.1);
  testing::run_ranks_shared(
      kPP,
      [&](std::shared_ptr<Communicator> comm) {
        torch::set_num_threads(1);
        const int r = comm->rank();
        auto model = pipeline::testing::make_mlp(kPP);
        pipeline::PipelineRuntime rt(
            cohort::DeviceMesh::from_group(comm, "pp"),
            {pipeline::PipelineStage(r, pipeline::split_sequential(model, {2}, r))},
            pipeline::Schedule1F1B(kPP, kM), pipeline::testing::mse);
        rt.step({x}, {y});
        actions[static_cast<size_t>(r)] = rt.schedule().actions[static_cast<size_t>(r)];
      },
      options);

  for (int r = 0; r < kPP; ++r) {
    const json doc = read_json(dir / ("rank-" + std::to_string(r) + ".json"));
    const json& events = doc.at("traceEvents");
    expect_nested(events, r);
    std::multiset<std::string> expected, traced;
    for (const auto& a : actions[static_cast<size_t>(r)]) expected.insert(pipeline::to_string(a));
    double step_begin = 0, step_end = -1;
    for (const auto& e : events) {
      if (e.value("name", "") == "pipeline step") {
        step_begin = e["ts"].get<double>();
        step_end = step_begin + e["dur"].get<double>();
      }
    }
    for (const auto& e : events) {
      const std::string cat = e.value("cat", "");
      if (cat != "pipeline.compute" && cat != "pipeline.comm") continue;
      const json& args = e["args"];
      // "1SEND_B2": the schedule's text form of (stage, name, micro-batch).
      const std::string token = std::to_string(args["stage"].get<int>()) +
                                e["name"].get<std::string>() +
                                std::to_string(args["microbatch"].get<int>());
      traced.insert(token);
      EXPECT_EQ(cat == "pipeline.compute",
                pipeline::is_compute(pipeline::parse_action(token).type));
      EXPECT_GE(e["ts"].get<double>(), step_begin - 1e-3) << "rank " << r;
      EXPECT_LE(e["ts"].get<double>() + e["dur"].get<double>(), step_end + 1e-3) << "rank " << r;
      if (args.contains("blocked_us")) {
        EXPECT_GE(args["blocked_us"].get<double>(), 0.0);
        EXPECT_LE(args["blocked_us"].get<double>(), e["dur"].get<double>() + 1e-3);
        EXPECT_EQ(args["peer"], 1 - r);
      }
    }
    EXPECT_EQ(traced, expected) << "rank " << r;
  }

  const auto summary = cohort_trace::summarize_trace(
      cohort_trace::merge_traces(cohort_trace::read_rank_traces(dir.str())));
  ASSERT_EQ(summary.size(), static_cast<size_t>(kPP));
  for (const auto& s : summary) {
    EXPECT_EQ(s.pipeline_actions,
              static_cast<int64_t>(actions[static_cast<size_t>(s.rank)].size()));
    EXPECT_GT(s.pipeline_compute_s, 0.0);
    EXPECT_GT(s.busy_s, 0.0);
    EXPECT_GT(s.comm_s, 0.0);  // every rank receives in 1F1B
    EXPECT_LE(s.pipeline_blocked_s, s.comm_s + 1e-9);
    EXPECT_NEAR(s.busy_s + s.comm_s + s.idle_s, s.wall_s, 1e-9 + 1e-9 * s.wall_s);
  }
  EXPECT_NE(cohort_trace::format_summary(summary).find("pipeline:"), std::string::npos);
}

// A cap of 5 events (CommunicatorOptions::trace_max_events): every rank keeps
// 5, the file parses and says how many it dropped, and so does the summary.
TEST(Trace, CappedTraceCountsWhatItDropped) {
  constexpr int kCap = 5, kOps = 10;
  testing::TempDir dir("cohort-trace");
  testing::ThreadRanksOptions options;
  options.trace_dir = dir.str();
  options.trace_max_events = kCap;
  testing::run_ranks_shared(
      2,
      [&](std::shared_ptr<Communicator> comm) {
        auto t = torch::ones({4});
        for (int i = 0; i < kOps; ++i) comm->all_reduce(t).wait();
        EXPECT_EQ(comm->tracer()->event_count(), static_cast<size_t>(kCap));
        EXPECT_EQ(comm->tracer()->max_events(), static_cast<size_t>(kCap));
      },
      options);
  for (int r = 0; r < 2; ++r) {
    const json doc = read_json(dir / ("rank-" + std::to_string(r) + ".json"));
    int kept = 0;
    int64_t marked = -1;
    for (const auto& e : doc["traceEvents"]) {
      const std::string ph = e["ph"];
      if (e.value("name", "") == "dropped events") {
        marked = e["args"]["dropped"].get<int64_t>();
        EXPECT_EQ(e["args"]["max_events"], kCap);
      } else if (ph == "X" || ph == "i" || ph == "b") {
        ++kept;  // a "b" and its "e" are one event
      }
    }
    EXPECT_EQ(kept, kCap) << "rank " << r;
    // Each all_reduce records its issue, its wait and its flight.
    const int64_t dropped = doc["otherData"]["dropped_events"].get<int64_t>();
    EXPECT_GE(dropped, 3 * kOps - kCap) << "rank " << r;
    EXPECT_EQ(marked, dropped) << "rank " << r;
  }
  const auto summary = cohort_trace::summarize_trace(
      cohort_trace::merge_traces(cohort_trace::read_rank_traces(dir.str())));
  ASSERT_EQ(summary.size(), 2u);
  EXPECT_GE(summary[0].dropped_events, 3 * kOps - kCap);
  EXPECT_NE(cohort_trace::format_summary(summary).find("events dropped"), std::string::npos);
}

TEST(Trace, OffByDefaultWritesNothing) {
  testing::TempDir dir("cohort-trace");
  testing::run_ranks(2, [&](Communicator& comm) {
    EXPECT_EQ(comm.tracer(), nullptr);
    auto t = torch::ones({4});
    comm.all_reduce(t).wait();
    auto g = comm.new_group({0, 1});
    EXPECT_EQ(g->tracer(), nullptr);
  });
  EXPECT_TRUE(std::filesystem::is_empty(dir.str()));
}

TEST(Trace, SubgroupsShareTheRanksTimeline) {
  testing::TempDir dir("cohort-trace");
  testing::ThreadRanksOptions options;
  options.trace_dir = dir.str();
  testing::run_ranks_shared(
      3,
      [&](std::shared_ptr<Communicator> comm) {
        auto g = comm->new_group({0, 2});
        if (!g) return;
        EXPECT_EQ(g->tracer(), comm->tracer());
        auto t = torch::ones({3});
        g->all_reduce(t).wait();
      },
      options);
  // Three files, named by world rank; the group's all_reduce is in rank 2's.
  for (int r = 0; r < 3; ++r)
    EXPECT_TRUE(std::filesystem::exists(dir / ("rank-" + std::to_string(r) + ".json")));
  // Nothing but the three traces: no temporary file is left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.str()), {}), 3);
  const json doc = read_json(dir / "rank-2.json");
  bool found = false;
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("cat", "") == "comm" && e["name"] == "all_reduce") {
      found = true;
      EXPECT_EQ(e["args"]["group"], "world/g0");
      EXPECT_EQ(e["args"]["bytes"], 12);
    }
  }
  EXPECT_TRUE(found);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Someone who can write the trace folder plants symlinks where a trace or its
// temporary file would go: flush() follows neither, and writes the trace.
TEST(Trace, PlantedSymlinksAreNotFollowed) {
  testing::TempDir dir("cohort-trace");
  const auto victim = dir / "victim", other = dir / "other";
  { std::ofstream(victim) << "precious"; }
  { std::ofstream(other) << "also precious"; }
  std::filesystem::create_directories(dir / "t");
  std::filesystem::create_symlink(victim, dir / "t/rank-0.json.tmp");
  std::filesystem::create_symlink(other, dir / "t/rank-0.json");
  {
    Tracer tracer(0, 1, dir / "t/rank-0.json");
    const auto t0 = Tracer::Clock::now();
    tracer.instant("mark", "test", t0);
  }
  EXPECT_EQ(read_text(victim), "precious");
  EXPECT_EQ(read_text(other), "also precious");
  EXPECT_FALSE(std::filesystem::is_symlink(dir / "t/rank-0.json"));
  EXPECT_EQ(read_json(dir / "t/rank-0.json")["traceEvents"].size(), 3u);
  // The planted link is left alone, and the temporary file is gone.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir / "t"), {}), 2);
}

TEST(Trace, UnwritableFolderIsRefusedWhenTheTracerIsBuilt) {
  testing::TempDir dir("cohort-trace");
  { std::ofstream(dir / "file") << "not a folder"; }
  const std::string path = dir / "file/sub/rank-3.json";
  try {
    Tracer tracer(3, 4, path);
    ADD_FAILURE() << "a trace under a regular file was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3: cannot write the trace " + path),
              std::string::npos)
        << e.what();
  }
}

TEST(Trace, TracerWritesValidJsonWithEscapedNames) {
  testing::TempDir dir("cohort-trace");
  {
    Tracer tracer(0, 1, dir / "sub/rank-0.json");
    const auto t0 = Tracer::Clock::now();
    tracer.complete("quote \" and \\ and \n", "test", t0, t0 + std::chrono::microseconds(5),
                    {TraceArg::str("text", "a\tb"), TraceArg::num("n", 1.5)});
    tracer.instant("mark", "test", t0);
    tracer.async_span("flight", "test", tracer.new_id(), t0, t0 + std::chrono::microseconds(7));
    EXPECT_EQ(tracer.event_count(), 3u);
  }
  const json doc = read_json(dir / "sub/rank-0.json");
  const auto& ev = doc["traceEvents"];
  ASSERT_EQ(ev.size(), 2u + 4u);  // two metadata events, X, i, b and e
  EXPECT_EQ(ev[2]["name"], "quote \" and \\ and \n");
  EXPECT_DOUBLE_EQ(ev[2]["dur"].get<double>(), 5.0);
  EXPECT_EQ(ev[2]["args"]["text"], "a\tb");
  EXPECT_DOUBLE_EQ(ev[5]["ts"].get<double>() - ev[4]["ts"].get<double>(), 7.0);
}

TEST(Trace, CohortrunTraceMergesOneLanePerRank) {
  testing::TempDir dir("cohort-trace");
  const auto trace_dir = dir / "t";
  auto r = testing::run_cohortrun({"-n", "2", "--trace", trace_dir, "--", TRACED_DDP_BIN},
                                  testing::Seconds(60));
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.err.find("trace of 2 rank(s)"), std::string::npos) << r.err;
  const json merged = read_json(trace_dir + "/trace.json");
  std::map<int, int> comm_events;
  for (const auto& e : merged["traceEvents"]) {
    if (e.value("cat", "") == "comm") ++comm_events[e["pid"].get<int>()];
  }
  ASSERT_EQ(comm_events.size(), 2u);
  EXPECT_EQ(comm_events[0], comm_events[1]);
  EXPECT_GT(comm_events[0], 3);
}

}  // namespace
}  // namespace cohort::trace_test
