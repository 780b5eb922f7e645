// What a timeline says across ranks holds: a collective has the same
// sequence number on every rank whatever point-to-point traffic came
// before it; a number no JSON can hold does not make the file unreadable;
// a merge says which ranks of the world have no file (a rank that died) and
// refuses files of different worlds (another run's left in the folder).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <map>

#include "cohort/cohort.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"
#include "trace_files.h"
#include "trace_summary.h"

namespace cohort::trace_integrity_test {
namespace {

using nlohmann::json;

json read_json(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return json::parse(in);  // throws (fails the test) if it does not parse
}

// The "seq" of every traced all_reduce on rank `r`, in issue order.
std::vector<int64_t> all_reduce_seqs(const std::string& dir, int r) {
  std::vector<int64_t> out;
  const json doc = read_json(dir + "/rank-" + std::to_string(r) + ".json");
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("cat", "") == "comm" && e.value("name", "") == "all_reduce") {
      out.push_back(e["args"]["seq"].get<int64_t>());
    }
  }
  return out;
}

class TraceSeq : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// Rank 0 sends to every other rank, which each receive once: rank 0 issues
// more operations than the others, yet the collectives after line up.
TEST_P(TraceSeq, CollectivesHaveOneNumberOnEveryRankAfterPointToPoint) {
  const auto [backend, world] = GetParam();
  testing::TempDir dir("cohort-trace-seq");
  testing::ThreadRanksOptions options;
  options.backend = backend;
  options.trace_dir = dir.str();
  testing::run_ranks(
      world,
      [&](Communicator& comm) {
        auto t = torch::ones({4});
        comm.all_reduce(t).wait();
        if (comm.rank() == 0) {
          for (int peer = 1; peer < world; ++peer) comm.send(t, peer).wait();
        } else {
          comm.recv(t, 0).wait();
        }
        comm.all_reduce(t).wait();
      },
      options);
  const auto rank0 = all_reduce_seqs(dir.str(), 0);
  ASSERT_EQ(rank0.size(), 2u);
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(all_reduce_seqs(dir.str(), r), rank0) << "rank " << r << " vs rank 0";
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, TraceSeq,
                         ::testing::Combine(::testing::Values(
#ifdef COHORT_WITH_UCX
                                                "ucx",
#endif
                                                "gloo"),
                                            ::testing::Values(3, 4)));

// A caller's argument that is not finite (a diverged loss) is written as
// null: the file still parses.
TEST(TraceFile, NonFiniteNumbersKeepTheFileValid) {
  testing::TempDir dir("cohort-trace-nan");
  const std::string path = dir / "rank-0.json";
  {
    Tracer t(0, 1, path);
    const auto now = Tracer::Clock::now();
    t.complete("step", "train", now, now,
               {TraceArg::num("loss", std::numeric_limits<double>::quiet_NaN()),
                TraceArg::num("grad_norm", std::numeric_limits<double>::infinity()),
                TraceArg::num("lr", 0.5)});
  }
  const json doc = read_json(path);
  const json& args = doc["traceEvents"].back()["args"];
  EXPECT_TRUE(args["loss"].is_null());
  EXPECT_TRUE(args["grad_norm"].is_null());
  EXPECT_EQ(args["lr"].get<double>(), 0.5);
}

// A rank file as Tracer writes it, for `world` ranks, one event at `ts`.
void write_rank_file(const std::string& dir, int rank, int world, double ts) {
  json event = json::object();
  event["ph"] = "X";
  event["name"] = "step";
  event["cat"] = "train";
  event["pid"] = rank;
  event["tid"] = 1;
  event["ts"] = ts;
  event["dur"] = 10.0;
  json doc = json::object();
  doc["traceEvents"] = json::array({event});
  doc["otherData"] = json::object();
  doc["otherData"]["rank"] = rank;
  doc["otherData"]["world_size"] = world;
  doc["otherData"]["clock_offset_us"] = 0.0;
  std::ofstream(dir + "/rank-" + std::to_string(rank) + ".json") << doc.dump();
}

// Rank 1 of 3 died without writing its file: the merge names it.
TEST(TraceMerge, NamesTheRanksWithoutAFile) {
  testing::TempDir dir("cohort-trace-merge");
  write_rank_file(dir.str(), 0, 3, 100);
  write_rank_file(dir.str(), 2, 3, 100);
  const json merged = cohort_trace::merge_traces(cohort_trace::read_rank_traces(dir.str()));
  EXPECT_EQ(merged["otherData"].value("world_size", 0), 3);
  EXPECT_EQ(merged["otherData"].value("missing_ranks", json::array()), json::array({1}));
}

// A folder holding one run of 4 ranks and a later run of 2: merging
// rank-2.json and rank-3.json with the new run's would mix two jobs.
TEST(TraceMerge, RefusesFilesOfDifferentWorlds) {
  testing::TempDir dir("cohort-trace-merge");
  for (int r = 0; r < 4; ++r) write_rank_file(dir.str(), r, 4, 100);
  for (int r = 0; r < 2; ++r) write_rank_file(dir.str(), r, 2, 900);
  try {
    cohort_trace::read_rank_traces(dir.str());
    ADD_FAILURE() << "files of a world of 2 and of 4 were read as one trace";
  } catch (const cohort_trace::TraceError& e) {
    EXPECT_NE(std::string(e.what()).find("rank-2.json is rank 2 of 4"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace cohort::trace_integrity_test
