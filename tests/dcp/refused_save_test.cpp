// A save refused before it writes (here a shard shaped otherwise than its
// box on the last rank: an InvalidArgument on every rank) leaves the
// checkpoint already in its folder whole and loadable: dcp::save and
// dcp::async_save, and an async save into the folder of a pending one
// (which the refused call commits first), over gloo and UCX at worlds 1
// and 3.
#include "cohort/dcp/async_save.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::refused_save_test {
namespace {

namespace fs = std::filesystem;

// Tensor "x", [3, 4], every rank holding all of it: `data`.
dcp::StateDict one_tensor(const torch::Tensor& data) {
  dcp::StateDict sd;
  sd.tensors.push_back({"x", {3, 4}, torch::kFloat, true, {{dcp::whole({3, 4}), data}}});
  return sd;
}

// The last rank's shard is [4, 3]: every rank refuses the save.
dcp::StateDict refused(const Communicator& comm, const torch::Tensor& values) {
  const bool bad = comm.rank() == comm.size() - 1;
  return one_tensor(bad ? values.view({4, 3}) : values.view({3, 4}));
}

enum class Op { Save, AsyncSave, AsyncSaveOverPending };

std::string op_name(Op op) {
  const char* names[] = {"save", "async_save", "async_save_over_pending"};
  return names[static_cast<int>(op)];
}

using Case = std::tuple<Op, EngineWorld>;

class RefusedSave : public ::testing::TestWithParam<Case> {};

TEST_P(RefusedSave, KeepsTheCheckpointInItsFolder) {
  const auto [op, engine] = GetParam();
  const auto dir =
      temp_dir("refused_" + op_name(op) + "_" + engine.backend + std::to_string(engine.world));
  const auto kept = torch::arange(12, torch::kFloat).view({3, 4});
  const auto other = kept + 100;
  auto options = options_for(engine);
  options.timeout = std::chrono::seconds(3);
  if (op != Op::AsyncSaveOverPending) {
    run_ranks_shared(
        engine.world,
        [&](std::shared_ptr<Communicator> comm) { dcp::save(one_tensor(kept), dir, *comm); },
        options);
  }
  const auto errors = errors_on_every_rank(
      engine.world,
      [&, op = op](std::shared_ptr<Communicator> comm) {
        try {
          if (op == Op::Save) {
            dcp::save(refused(*comm, other), dir, *comm);
          } else if (op == Op::AsyncSave) {
            dcp::async_save(refused(*comm, other), dir, *comm).wait();
          } else {
            // The pending save is committed by the refused call, and stays.
            auto pending = dcp::async_save(one_tensor(kept), dir, *comm);
            dcp::async_save(refused(*comm, other), dir, *comm).wait();
          }
        } catch (const InvalidArgument& e) {
          throw std::runtime_error(std::string("InvalidArgument: ") + e.what());
        }
      },
      options);
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_EQ(errors[r].rfind("InvalidArgument: ", 0), 0u) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("tensor x on rank " + std::to_string(engine.world - 1)),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  ASSERT_TRUE(fs::exists(dir / ".metadata")) << "the refused save removed the checkpoint";
  EXPECT_TRUE(torch::equal(dcp::read_tensor(dir, dcp::read_metadata(dir), "x"), kept));
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Ops, RefusedSave,
                         ::testing::Combine(::testing::Values(Op::Save, Op::AsyncSave,
                                                              Op::AsyncSaveOverPending),
                                            ::testing::ValuesIn(engine_worlds({1, 3}))),
                         [](const auto& info) {
                           const auto& e = std::get<1>(info.param);
                           return op_name(std::get<0>(info.param)) + "_" + e.backend + "_world" +
                                  std::to_string(e.world);
                         });

}  // namespace
}  // namespace cohort::testing::dcp_test::refused_save_test
