// dcp::save creates the folder it saves into with its missing parents, on
// every rank, at worlds 1 and 3, and what it saved loads back exactly; a
// folder that cannot be created (a file stands where a parent should be) is
// a CheckpointError on every rank naming the folder.
#include <fstream>

#include "support/rank_errors.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::folder_test {
namespace {

namespace fs = std::filesystem;

class SaveFolder : public ::testing::TestWithParam<int> {};

TEST_P(SaveFolder, MissingParentsAreCreated) {
  const int world = GetParam();
  const auto root = temp_dir("folder_w" + std::to_string(world));
  const auto dir = root / "a" / "b" / "c";
  ASSERT_FALSE(fs::exists(root / "a"));
  Named saved;
  run_ranks(world, [&](Communicator& comm) {
    Net net(1, false);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    train(net, 2, [&] { opt.step(); });
    if (comm.rank() == 0) saved = snapshot(*net, &opt);
    dcp::save(dcp::get_state_dict(*net, opt), dir, comm);
  });
  ASSERT_TRUE(fs::is_regular_file(dir / ".metadata"));
  run_ranks(world, [&](Communicator& comm) {
    Net net(2, false);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    train(net, 1, [&] { opt.step(); });
    const auto meta = dcp::read_metadata(dir);
    auto sd = dcp::get_state_dict(*net, opt);
    dcp::load(sd, dir, comm, &meta);
    expect_equal(snapshot(*net, &opt), saved, "rank " + std::to_string(comm.rank()));
  });
  fs::remove_all(root);
}

TEST_P(SaveFolder, UncreatableFolderIsACheckpointErrorOnEveryRank) {
  const int world = GetParam();
  const auto root = temp_dir("folder_bad_w" + std::to_string(world));
  std::ofstream(root / "file") << "not a folder";
  const auto dir = (root / "file" / "sub").string();
  const auto errors = errors_on_every_rank(world, [&](std::shared_ptr<Communicator> comm) {
    Net net(1, false);
    try {
      dcp::save(dcp::get_state_dict(*net), dir, *comm);
    } catch (const CheckpointError& e) {
      throw std::runtime_error(std::string("CheckpointError: ") + e.what());
    }
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[r].rfind("CheckpointError: ", 0), 0u) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find(dir + ": cannot create the folder"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  fs::remove_all(root);
}

INSTANTIATE_TEST_SUITE_P(Worlds, SaveFolder, ::testing::Values(1, 3));

}  // namespace
}  // namespace cohort::testing::dcp_test::folder_test
