// The point-to-point message cases (message_cases.h) with ranks as threads
// over UCX, at worlds 2 and 3 (a message needs two ranks; at 3 a rank only
// watches): a receive whose buffer differs from the send in size or dtype
// is a MismatchError naming the peer, the tag, both sizes and both dtypes,
// on the receiver and on the sender. Gloo's point-to-point is not covered
// here. Over MPI: tests/mpi/message_world.cpp.
#include <gtest/gtest.h>

#include <tuple>

#include "support/thread_ranks.h"
#include "tests/comm/message_cases.h"

namespace cohort::testing::message_test {
namespace {

using Param = std::tuple<int, size_t>;  // world, case

const MessageEngine kUcx{"rank", true, true};

ThreadRanksOptions ucx() {
  ThreadRanksOptions o;
  o.backend = "ucx";
  o.timeout = kMessageTimeout;
  return o;
}

class UcxMessage : public ::testing::TestWithParam<Param> {};

TEST_P(UcxMessage, OtherSizeOrDtypeIsAMismatchErrorOnBothRanks) {
  const auto& [world, index] = GetParam();
  run_ranks(
      world, [&](Communicator& comm) { run_message_case(comm, message_cases()[index], kUcx); },
      ucx());
}

std::vector<Param> params() {
  std::vector<Param> ps;
  for (int world : {2, 3}) {
    for (size_t c = 0; c < message_cases().size(); ++c) ps.emplace_back(world, c);
  }
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Ucx, UcxMessage, ::testing::ValuesIn(params()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) + "_" +
                                  message_cases()[std::get<1>(info.param)].name;
                         });

class UcxMatchingMessage : public ::testing::TestWithParam<int> {};

TEST_P(UcxMatchingMessage, ArriveWhole) {
  run_ranks(
      GetParam(), [](Communicator& comm) { run_matching_messages(comm); }, ucx());
}

INSTANTIATE_TEST_SUITE_P(Ucx, UcxMatchingMessage, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "world" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace cohort::testing::message_test
