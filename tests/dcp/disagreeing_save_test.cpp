// A save whose ranks' state dicts disagree (shards that overlap, leave a
// hole or lie outside the tensor; a tensor of another shape or dtype on one
// rank; a replicated tensor missing on one rank, listed in another order,
// of another shape, or not replicated there) is refused with one
// InvalidArgument on every rank, naming the tensor and the ranks, before
// any rank touches the folder: the checkpoint already in it stays byte for
// byte. dcp::save, dcp::async_save and an async save into the folder of a
// pending one, over gloo and UCX at worlds 1 to 3 (the kinds that need two
// ranks from 2).
#include <fstream>
#include <sstream>

#include "cohort/dcp/async_save.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::disagreeing_save_test {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kRows = 6, kCols = 4;

enum class Kind {
  Overlap,            // the last rank also holds row 0
  Hole,               // the last rank leaves out its last row
  Outside,            // the last rank's box passes the last row
  Shape,              // the last rank's x is [7, 4]
  Dtype,              // the last rank's x is float64
  ReplicatedMissing,  // the last rank lacks the replicated r
  ReplicatedOrder,    // the last rank lists s before r
  ReplicatedShape,    // the last rank's r is [3, 2]
  NotReplicated,      // the last rank's r is its own whole box, not replicated
};

const char* kind_name(Kind k) {
  const char* names[] = {"overlap",
                         "hole",
                         "outside",
                         "shape",
                         "dtype",
                         "replicated_missing",
                         "replicated_order",
                         "replicated_shape",
                         "not_replicated"};
  return names[static_cast<int>(k)];
}

// The tensor each kind's error must name.
std::string tensor_of(Kind k) {
  if (k == Kind::ReplicatedMissing || k == Kind::ReplicatedShape || k == Kind::NotReplicated) {
    return "tensor r";
  }
  return k == Kind::ReplicatedOrder ? "replicated tensors" : "tensor x";
}

bool needs_two_ranks(Kind k) { return k >= Kind::Shape; }

// x [6, 4] in rows dealt evenly over the ranks (6 divides by 1, 2 and 3),
// replicated r [2, 3] and s [5]; every value from `base` up. With `bad`,
// the last rank's state dict disagrees as `kind` says.
dcp::StateDict state(const Communicator& comm, float base, bool bad, Kind kind) {
  const auto x = torch::arange(kRows * kCols, torch::kFloat).view({kRows, kCols}) + base;
  const auto r = torch::arange(6, torch::kFloat).view({2, 3}) + base + 100;
  const auto s = torch::arange(5, torch::kFloat) + base + 200;
  const int64_t lo = kRows * comm.rank() / comm.size(),
                hi = kRows * (comm.rank() + 1) / comm.size();
  const bool last = bad && comm.rank() == comm.size() - 1;
  auto rows = [](int64_t a, int64_t b) { return dcp::Box{{a, 0}, {b - a, kCols}}; };
  dcp::StateDict sd;
  dcp::TensorEntry xe{
      "x", {kRows, kCols}, torch::kFloat, false, {{rows(lo, hi), x.slice(0, lo, hi)}}};
  if (last && kind == Kind::Overlap) xe.shards.push_back({rows(0, 1), x.slice(0, 0, 1)});
  if (last && kind == Kind::Hole) xe.shards[0] = {rows(lo, hi - 1), x.slice(0, lo, hi - 1)};
  if (last && kind == Kind::Outside) {
    xe.shards[0] = {rows(lo, hi + 1), torch::cat({x.slice(0, lo, hi), x.slice(0, 0, 1)})};
  }
  if (last && kind == Kind::Shape) xe.shape = {kRows + 1, kCols};
  if (last && kind == Kind::Dtype) {
    xe.dtype = torch::kDouble;
    xe.shards[0].data = xe.shards[0].data.to(torch::kDouble);
  }
  dcp::TensorEntry re{"r", {2, 3}, torch::kFloat, true, {{dcp::whole({2, 3}), r}}};
  dcp::TensorEntry se{"s", {5}, torch::kFloat, true, {{dcp::whole({5}), s}}};
  if (last && kind == Kind::ReplicatedShape) {
    re.shape = {3, 2};
    re.shards[0] = {dcp::whole({3, 2}), r.view({3, 2})};
  }
  if (last && kind == Kind::NotReplicated) re.replicated = false;
  sd.tensors.push_back(xe);
  if (last && kind == Kind::ReplicatedOrder) {
    sd.tensors.push_back(se);
    sd.tensors.push_back(re);
  } else {
    if (!(last && kind == Kind::ReplicatedMissing)) sd.tensors.push_back(re);
    sd.tensors.push_back(se);
  }
  return sd;
}

// Every file of `dir` by name, with its bytes.
std::map<std::string, std::string> files_of(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    std::ostringstream bytes;
    bytes << in.rdbuf();
    out[e.path().filename().string()] = bytes.str();
  }
  return out;
}

enum class Op { Save, AsyncSave, AsyncSaveOverPending };

std::string op_name(Op op) {
  const char* names[] = {"save", "async_save", "async_save_over_pending"};
  return names[static_cast<int>(op)];
}

using Case = std::tuple<Kind, Op, EngineWorld>;

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int k = 0; k <= static_cast<int>(Kind::NotReplicated); ++k) {
    for (Op op : {Op::Save, Op::AsyncSave, Op::AsyncSaveOverPending}) {
      for (const auto& e : engine_worlds({1, 2, 3})) {
        if (e.world == 1 && needs_two_ranks(static_cast<Kind>(k))) continue;
        out.emplace_back(static_cast<Kind>(k), op, e);
      }
    }
  }
  return out;
}

class DisagreeingSave : public ::testing::TestWithParam<Case> {};

TEST_P(DisagreeingSave, IsRefusedOnEveryRankAndKeepsTheCheckpoint) {
  const auto [kind, op, engine] = GetParam();
  const auto dir = temp_dir("disagree_" + std::string(kind_name(kind)) + "_" + op_name(op) + "_" +
                            engine.backend + std::to_string(engine.world));
  auto options = options_for(engine);
  options.timeout = std::chrono::seconds(3);
  std::map<std::string, std::string> before;
  if (op != Op::AsyncSaveOverPending) {
    run_ranks_shared(
        engine.world,
        [&](std::shared_ptr<Communicator> comm) {
          dcp::save(state(*comm, 0, false, kind), dir, *comm);
        },
        options);
    before = files_of(dir);
  }
  const auto errors = errors_on_every_rank(
      engine.world,
      [&, kind = kind, op = op](std::shared_ptr<Communicator> comm) {
        try {
          const auto bad = state(*comm, 1000, true, kind);
          if (op == Op::Save) {
            dcp::save(bad, dir, *comm);
          } else if (op == Op::AsyncSave) {
            dcp::async_save(bad, dir, *comm).wait();
          } else {
            // Committed by the refused call, and kept.
            auto pending = dcp::async_save(state(*comm, 0, false, kind), dir, *comm);
            dcp::async_save(bad, dir, *comm).wait();
          }
        } catch (const InvalidArgument& e) {
          throw std::runtime_error(std::string("InvalidArgument: ") + e.what());
        }
      },
      options);
  const auto last = "rank " + std::to_string(engine.world - 1);
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_EQ(errors[r], errors[0]) << "rank " << r << " differs from rank 0";
    EXPECT_EQ(errors[r].rfind("InvalidArgument: dcp::", 0), 0u)
        << "rank " << r << ": " << errors[r];
    for (const auto& part : {tensor_of(kind), last}) {
      EXPECT_NE(errors[r].find(part), std::string::npos) << "rank " << r << ": " << errors[r];
    }
  }
  ASSERT_TRUE(fs::exists(dir / ".metadata")) << "the refused save removed the checkpoint";
  if (op != Op::AsyncSaveOverPending) {
    EXPECT_TRUE(files_of(dir) == before) << "the refused save changed the folder's files";
  }
  const auto meta = dcp::read_metadata(dir);
  ASSERT_EQ(meta.tensors.size(), 3u);
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    for (const auto& t : state(*comm, 0, false, kind).tensors) {
      EXPECT_TRUE(torch::equal(dcp::read_tensor(dir, meta, t.fqn), t.shards[0].data)) << t.fqn;
    }
  });
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Kinds, DisagreeingSave, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           const auto& e = std::get<2>(info.param);
                           return std::string(kind_name(std::get<0>(info.param))) + "_" +
                                  op_name(std::get<1>(info.param)) + "_" + e.backend + "_world" +
                                  std::to_string(e.world);
                         });

}  // namespace
}  // namespace cohort::testing::dcp_test::disagreeing_save_test
