// The point-to-point message cases (message_cases.h) with ranks as threads
// over Gloo and UCX, at worlds 2 and 3 (a message needs two ranks; at 3 a
// rank only watches): a receive whose buffer differs from the send in size
// or dtype is a MismatchError naming the peer, the tag, both sizes and both
// dtypes, on the receiver, and (UCX) on the sender. A longer message over
// Gloo ends the process inside Gloo (cohort/comm/README.md), so Gloo runs
// the other cases. Over MPI: tests/mpi/message_world.cpp.
#include <gtest/gtest.h>

#include <tuple>

#include "support/thread_ranks.h"
#include "tests/comm/message_cases.h"

namespace cohort::testing::message_test {
namespace {

using Param = std::tuple<std::string, int, size_t>;  // engine, world, case

// Gloo: the header carries the sender's dtype; the sender is not told.
MessageEngine engine_of(const std::string& backend) {
  return backend == "ucx" ? MessageEngine{"rank", true, true} : MessageEngine{"rank", true, false};
}

ThreadRanksOptions options(const std::string& backend) {
  ThreadRanksOptions o;
  o.backend = backend;
  o.timeout = kMessageTimeout;
  return o;
}

bool longer(const MessageCase& c) { return c.sent.nbytes() > c.buffer.nbytes(); }

class Message : public ::testing::TestWithParam<Param> {};

TEST_P(Message, OtherSizeOrDtypeIsAMismatchError) {
  const auto& [backend, world, index] = GetParam();
  run_ranks(
      world,
      [&](Communicator& comm) {
        run_message_case(comm, message_cases()[index], engine_of(backend));
      },
      options(backend));
}

std::vector<Param> params(const std::string& backend) {
  std::vector<Param> ps;
  for (int world : {2, 3}) {
    for (size_t c = 0; c < message_cases().size(); ++c) {
      if (backend == "gloo" && longer(message_cases()[c])) continue;
      ps.emplace_back(backend, world, c);
    }
  }
  return ps;
}

std::string name_of(const ::testing::TestParamInfo<Param>& info) {
  return "world" + std::to_string(std::get<1>(info.param)) + "_" +
         message_cases()[std::get<2>(info.param)].name;
}

INSTANTIATE_TEST_SUITE_P(Gloo, Message, ::testing::ValuesIn(params("gloo")), name_of);
#ifdef COHORT_WITH_UCX
INSTANTIATE_TEST_SUITE_P(Ucx, Message, ::testing::ValuesIn(params("ucx")), name_of);
#endif

using MatchingParam = std::tuple<std::string, int>;  // engine, world
class MatchingMessage : public ::testing::TestWithParam<MatchingParam> {};

TEST_P(MatchingMessage, ArriveWhole) {
  const auto& [backend, world] = GetParam();
  run_ranks(
      world, [](Communicator& comm) { run_matching_messages(comm); }, options(backend));
}

std::string matching_name(const ::testing::TestParamInfo<MatchingParam>& info) {
  return "world" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Gloo, MatchingMessage,
                         ::testing::Combine(::testing::Values("gloo"), ::testing::Values(2, 3)),
                         matching_name);
#ifdef COHORT_WITH_UCX
INSTANTIATE_TEST_SUITE_P(Ucx, MatchingMessage,
                         ::testing::Combine(::testing::Values("ucx"), ::testing::Values(2, 3)),
                         matching_name);
#endif

}  // namespace
}  // namespace cohort::testing::message_test
