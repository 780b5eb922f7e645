// The point-to-point message cases (tests/comm/message_cases.h) over MPI,
// ranks as processes under mpirun: a receive whose buffer has another size
// than the message is a MismatchError on the receiver naming the peer, the
// tag, both sizes and its own dtype, never MPI's abort. MPI carries no
// dtype: a message of another dtype with the same bytes arrives (the
// engine's README says so), and the sender's send completed before the
// receiver could tell it. Each case runs on a group of its own (a failed
// receive ends its communicator).
#include <gtest/gtest.h>

#include "cohort/cohort.h"
#include "tests/comm/message_cases.h"

namespace cohort::testing::message_world {
namespace {

const MessageEngine kMpi{"peer", false, false};

std::shared_ptr<Communicator> fresh_group() {
  std::vector<int> all(static_cast<size_t>(world().size()));
  for (int r = 0; r < world().size(); ++r) all[static_cast<size_t>(r)] = r;
  auto options = world().options();
  options.timeout = kMessageTimeout;
  return world().new_group(all, options);
}

class MpiMessage : public ::testing::TestWithParam<size_t> {};

TEST_P(MpiMessage, OtherSizeIsAMismatchErrorOnTheReceiver) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  auto group = fresh_group();
  run_message_case(*group, message_cases()[GetParam()], kMpi);
  world().barrier().wait();  // the job goes on, on every rank
}

INSTANTIATE_TEST_SUITE_P(Cases, MpiMessage, ::testing::Range(size_t{0}, message_cases().size()),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           return message_cases()[info.param].name;
                         });

TEST(MpiMatchingMessages, ArriveWhole) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  auto group = fresh_group();
  run_matching_messages(*group);
}

}  // namespace
}  // namespace cohort::testing::message_world
