// Bad command lines: one clear line on stderr, exit code 2, nothing run.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "support/subprocess.h"

namespace cohort::testing::arguments_test {
namespace {

struct BadArgs {
  std::string name;  // the test's name suffix
  std::vector<std::string> args;
  std::string message;  // expected in the error line
};

// Shown by GoogleTest on failure: the command line, not the struct's bytes.
void PrintTo(const BadArgs& bad, std::ostream* os) {
  *os << "cohortrun";
  for (const std::string& arg : bad.args) *os << " " << arg;
}

class Arguments : public ::testing::TestWithParam<BadArgs> {};

void expect_usage_error(const ProcessResult& r, const std::string& message) {
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.out, "");  // nothing ran
  EXPECT_EQ(lines_of(r.err).size(), 1u) << r.err;
  EXPECT_EQ(r.err.rfind("cohortrun: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
}

TEST_P(Arguments, RejectedWithClearMessage) {
  std::vector<std::string> args = GetParam().args;
  expect_usage_error(run_cohortrun(args), GetParam().message);
}

// The program, when reached, would print: a rejected line must not start it.
#define PROG "--", "echo", "ran"

INSTANTIATE_TEST_SUITE_P(
    Launcher, Arguments,
    ::testing::Values(
        BadArgs{"NegativeN", {"-n", "-1", PROG}, "-n must be a positive number"},
        BadArgs{"ZeroN", {"-n", "0", PROG}, "-n must be a positive number"},
        BadArgs{"NonNumericN", {"-n", "two", PROG}, "-n must be an integer"},
        BadArgs{"HugeN", {"-n", "100000", PROG}, "-n must be at most 1024"},
        BadArgs{"MissingN", {PROG}, "-n (ranks per node) is required"},
        BadArgs{"NoProgram", {"-n", "2"}, "missing program after '--'"},
        BadArgs{"NothingAfterDashes", {"-n", "2", "--"}, "missing program after '--'"},
        BadArgs{"UnknownOption", {"-n", "2", "--bogus", PROG}, "unknown option '--bogus'"},
        BadArgs{"NonNumericPort",
                {"-n", "2", "--master-port", "http", PROG},
                "--master-port must be an integer"},
        BadArgs{"PortTooLarge",
                {"-n", "2", "--master-port", "70000", PROG},
                "--master-port must be in 1..65535"},
        BadArgs{"PortZero",
                {"-n", "2", "--master-port", "0", PROG},
                "--master-port must be in 1..65535"},
        BadArgs{"NodeRankTooLarge",
                {"-n", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1",
                 "--master-port", "29500", PROG},
                "--node-rank 2 is out of range for --nnodes 2"},
        BadArgs{"NegativeNodeRank",
                {"-n", "2", "--node-rank", "-1", PROG},
                "--node-rank -1 is out of range"},
        BadArgs{"MultiNodeWithoutAddr",
                {"-n", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "29500", PROG},
                "--master-addr is required when --nnodes > 1"},
        BadArgs{"MultiNodeWithoutPort",
                {"-n", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", PROG},
                "--master-port is required when --nnodes > 1"},
        BadArgs{"UnknownBackend",
                {"-n", "2", "--backend", "tcp", PROG},
                "--backend (or COHORT_BACKEND) must be gloo, mpi, ucx, nccl or auto"},
        BadArgs{"MultiNodeMpi",
                {"-n", "2", "--backend", "mpi", "--nnodes", "2", "--node-rank", "0",
                 "--master-addr", "10.0.0.1", "--master-port", "29500", PROG},
                "--backend mpi supports a single node only"},
        BadArgs{"NegativeTimeout",
                {"-n", "2", "--timeout", "-3", PROG},
                "--timeout must be a positive number"}),
    [](const ::testing::TestParamInfo<BadArgs>& info) { return info.param.name; });

TEST(Usage, PortInUseIsRejected) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string port = std::to_string(ntohs(addr.sin_port));

  ProcessResult r = run_cohortrun({"-n", "2", "--master-port", port, PROG});
  ::close(fd);
  expect_usage_error(r, "--master-port " + port + " is already in use on 127.0.0.1");
}

TEST(Usage, HelpExitsZero) {
  ProcessResult r = run_cohortrun({"--help"});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--max-restarts"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace cohort::testing::arguments_test
