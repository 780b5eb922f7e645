// Two "nodes" as two network namespaces joined by a veth pair, each running
// the same cohortrun command with its own --node-rank (over Gloo, and over
// UCX when it is built). Runs the library's
// smoke program (an all-reduce over all 4 ranks) when it is built, and a
// shell stand-in otherwise.
#include <gtest/gtest.h>

#include <memory>

#include "support/netns.h"
#include "support/subprocess.h"

namespace cohort::testing::multinode_test {
namespace {

constexpr int kRanksPerNode = 2;
constexpr const char* kMasterPort = "29577";

// Checks the environment and, with the tools at hand, that node 0 is
// reachable: ping if installed, else a TCP exchange between the ranks (rank
// 0 listens on MASTER_ADDR:MASTER_PORT and sums what the others send).
constexpr const char* kStandIn = R"sh(#!/bin/sh
fail() { echo "stand-in: $*"; exit 1; }
case "$RANK" in 0|1|2|3) ;; *) fail "bad RANK=$RANK" ;; esac
[ "$WORLD_SIZE" = 4 ] || fail "bad WORLD_SIZE=$WORLD_SIZE"
[ "$RANK" = $((GROUP_RANK * 2 + LOCAL_RANK)) ] || fail "RANK/GROUP_RANK mismatch"
[ "$MASTER_ADDR" = 10.77.0.1 ] || fail "bad MASTER_ADDR=$MASTER_ADDR"
if command -v ping >/dev/null 2>&1; then
  ping -c1 -W1 10.77.0.1 >/dev/null || fail "10.77.0.1 unreachable"
  echo "stand-in ok (ping)"
elif command -v python3 >/dev/null 2>&1; then
  python3 "$(dirname "$0")/exchange.py" || fail "tcp exchange failed"
else
  echo "stand-in ok (reachability not checked: no ping, no python3)"
fi
)sh";

constexpr const char* kExchange = R"py(
import os, socket, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
if rank == 0:
    server = socket.create_server(addr)
    server.settimeout(20)
    total = 1
    for _ in range(world - 1):
        conn, _ = server.accept()
        total += int(b"".join(iter(lambda: conn.recv(16), b"")))
        conn.close()
    ok = total == world * (world + 1) // 2
    print("stand-in ok (tcp sum %d)" % total if ok else "wrong sum %d" % total)
    sys.exit(0 if ok else 1)
deadline = time.time() + 20
while True:
    try:
        conn = socket.create_connection(addr, timeout=2)
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.05)
conn.sendall(str(rank + 1).encode())
conn.close()
print("stand-in ok (tcp)")
)py";

// Runs the two nodes with `backend`.
void run_two_nodes(const std::string& backend) {
  std::string why;
  std::unique_ptr<VethNamespaces> ns = VethNamespaces::create(&why);
  if (!ns) GTEST_SKIP() << "cannot set up two network namespaces: " << why;

  TempDir dir;
#ifdef COHORT_SMOKE_BIN
  const std::vector<std::string> program = {COHORT_SMOKE_BIN};
  const std::string success = "all_reduce ok";
  const std::string engine_line = "(backend " + backend + ")";
#else
  write_file(dir.path() + "/stand_in.sh", kStandIn, /*executable=*/true);
  write_file(dir.path() + "/exchange.py", kExchange);
  const std::vector<std::string> program = {dir.path() + "/stand_in.sh"};
  const std::string success = "stand-in ok";
  const std::string engine_line;  // the stand-in uses no engine
#endif

  std::vector<std::unique_ptr<Subprocess>> nodes;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv = {ns->ip(),
                                     "netns",
                                     "exec",
                                     ns->name(node),
                                     COHORTRUN_BIN,
                                     "-n",
                                     std::to_string(kRanksPerNode),
                                     "--nnodes",
                                     "2",
                                     "--node-rank",
                                     std::to_string(node),
                                     "--master-addr",
                                     VethNamespaces::address(0),
                                     "--master-port",
                                     kMasterPort,
                                     "--timeout",
                                     "90",
                                     "--backend",
                                     backend,
                                     "--"};
    argv.insert(argv.end(), program.begin(), program.end());
    nodes.push_back(std::make_unique<Subprocess>(argv));
  }
  for (int node = 0; node < 2; ++node) {
    ProcessResult r = nodes[node]->finish(Seconds(100));
    SCOPED_TRACE("node " + std::to_string(node));
    ASSERT_FALSE(r.timed_out) << r.out << r.err;
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_EQ(count_of(r.out, success), kRanksPerNode) << r.out << r.err;
    if (!engine_line.empty()) {
      EXPECT_EQ(count_of(r.out, engine_line), kRanksPerNode) << r.out;
    }
    for (int local = 0; local < kRanksPerNode; ++local) {
      std::string prefix = "[" + std::to_string(node * kRanksPerNode + local) + "] ";
      EXPECT_NE(r.out.find(prefix), std::string::npos) << r.out;
    }
  }
}

TEST(MultiNode, TwoNodesInNetworkNamespaces) { run_two_nodes("gloo"); }

#if defined(COHORT_TEST_UCX) && defined(COHORT_SMOKE_BIN)
// Each namespace is a host to the UCX engine: the ranks reach each other
// over UCX's TCP transport on the veth interface.
TEST(MultiNode, TwoNodesInNetworkNamespacesOverUcx) { run_two_nodes("ucx"); }
#endif

}  // namespace
}  // namespace cohort::testing::multinode_test
