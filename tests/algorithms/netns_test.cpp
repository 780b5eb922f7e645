// Hierarchical across two "hosts": two network namespaces joined by a veth
// pair (tests/launcher/netns.h), 2 ranks each, the link between them slowed
// by tc netem (1 Gbit/s, 0.5 ms) or, in kernels without netem, tbf
// (1 Gbit/s). Every algorithmic contract case under every algorithm must
// hold when the nodes are real (found from GROUP_RANK, set by cohortrun
// --node-rank); the speed comparison is bench/algorithms/netns.sh.
#include "support/netns.h"

#include <gtest/gtest.h>

#include "support/subprocess.h"

namespace cohort::testing::netns_test {
namespace {

// Slows every non-loopback device of namespace `ns`: netem (1 Gbit/s,
// 0.5 ms) where the kernel has it, else tbf (1 Gbit/s, no added delay).
// Returns "" or why neither worked.
std::string slow_down(const std::string& ip, const std::string& ns) {
  const std::string tc = find_program("tc");
  if (tc.empty()) return "no tc";
  ProcessResult r = run_process(
      {ip, "netns", "exec", ns, "sh", "-c",
       "for d in $(ls /sys/class/net); do [ \"$d\" = lo ] && continue; " + tc +
           " qdisc add dev \"$d\" root netem rate 1gbit delay 0.5ms 2>/dev/null || " + tc +
           " qdisc add dev \"$d\" root tbf rate 1gbit burst 128kb latency 50ms || exit 1; done"},
      Seconds(10));
  return r.exit_code == 0 ? "" : "tc failed: " + r.err;
}

TEST(Hierarchical, TwoHostsOfTwoRanksInNetworkNamespaces) {
  std::string why;
  std::unique_ptr<VethNamespaces> ns = VethNamespaces::create(&why);
  if (!ns) GTEST_SKIP() << "cannot set up two network namespaces: " << why;
  std::string netem;
  for (int i = 0; i < 2 && netem.empty(); ++i) netem = slow_down(ns->ip(), ns->name(i));
  if (!netem.empty()) std::printf("link not slowed (%s); correctness only\n", netem.c_str());

  std::vector<std::unique_ptr<Subprocess>> nodes;
  for (int node = 0; node < 2; ++node) {
    nodes.push_back(std::make_unique<Subprocess>(
        std::vector<std::string>{ns->ip(),
                                 "netns",
                                 "exec",
                                 ns->name(node),
                                 COHORTRUN_BIN,
                                 "-n",
                                 "2",
                                 "--nnodes",
                                 "2",
                                 "--node-rank",
                                 std::to_string(node),
                                 "--master-addr",
                                 VethNamespaces::address(0),
                                 "--master-port",
                                 "29581",
                                 "--timeout",
                                 "100",
                                 "--backend",
                                 "gloo",
                                 "--",
                                 CONTRACT_WORLD_BIN,
                                 "--gtest_filter=-Contract/World.Holds/world_*"},
        // Adaptive calibrates up to 64 KiB (tests/contract/world_test.cpp).
        std::vector<std::string>{"OPENBLAS_NUM_THREADS=1", "COHORT_TIMEOUT=60"}));
  }
  for (int node = 0; node < 2; ++node) {
    ProcessResult r = nodes[node]->finish(Seconds(110));
    SCOPED_TRACE("node " + std::to_string(node));
    ASSERT_FALSE(r.timed_out) << r.out << r.err;
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    if (node == 0) {
      // Rank 0 prints GoogleTest's report: every algorithmic contract case.
      EXPECT_NE(r.out.find("[  PASSED  ]"), std::string::npos) << r.out << r.err;
      EXPECT_EQ(r.out.find("FAILED"), std::string::npos) << r.out << r.err;
    }
  }
}

}  // namespace
}  // namespace cohort::testing::netns_test
