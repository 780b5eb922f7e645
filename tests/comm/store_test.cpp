// Stores: the TcpStore's protocol and its loopback-only listener, waits that
// time out naming the missing keys, prefixes that keep key spaces apart.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <thread>

#include "cohort/cohort.h"
#include "cohort/comm/gloo/c10d_adapter.h"
#include "cohort/core/store/socket.h"

namespace cohort::store_test {
namespace {

using namespace std::chrono_literals;

void exercise(Store& a, Store& b) {
  a.set_string("k", "v1");
  EXPECT_EQ(b.get_string("k"), "v1");
  EXPECT_EQ(a.add("n", 5), 5);
  EXPECT_EQ(b.add("n", -2), 3);
  EXPECT_TRUE(b.check({"k", "n"}));
  EXPECT_FALSE(b.check({"k", "absent"}));
  EXPECT_TRUE(a.delete_key("k"));
  EXPECT_FALSE(b.check({"k"}));

  // A wait is answered when another client sets the key.
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);  // let the wait start first
    a.set_string("late", "x");
  });
  b.wait({"late"}, 5s);
  setter.join();
  EXPECT_EQ(b.get_string("late"), "x");

  try {
    b.wait({"late", "never-1", "never-2"}, 200ms);
    ADD_FAILURE() << "wait should time out";
  } catch (const TimeoutError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("never-1, never-2"), std::string::npos) << m;
    EXPECT_EQ(m.find("late,"), std::string::npos) << m;
  }
  // Large values survive framing.
  std::vector<uint8_t> big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 31);
  a.set("big", big);
  EXPECT_EQ(b.get("big"), big);
}

TEST(TcpStore, TwoClientsShareOneServer) {
  TcpStore server("127.0.0.1", 0, true, 10s);
  TcpStore client("127.0.0.1", server.port(), false, 10s);
  exercise(server, client);
}

TEST(HashStore, Contract) {
  HashStore s;
  exercise(s, s);
}

TEST(FileStore, Contract) {
  auto path = ::testing::TempDir() + "cohort_filestore_" + std::to_string(::getpid());
  std::remove(path.c_str());
  auto a = make_file_store(path, 2, 10s);
  auto b = make_file_store(path, 2, 10s);
  exercise(*a, *b);
}

// The listening socket of a store on 127.0.0.1 must be bound to loopback
// alone: read the kernel's table of listening sockets.
TEST(TcpStore, ListensOnLoopbackOnly) {
  TcpStore server("127.0.0.1", 0, true, 10s);
  std::ifstream tcp("/proc/net/tcp");
  ASSERT_TRUE(tcp) << "no /proc/net/tcp";
  std::string line, local, remote, state;
  bool found = false;
  std::getline(tcp, line);  // header
  while (std::getline(tcp, line)) {
    std::istringstream is(line);
    std::string slot;
    is >> slot >> local >> remote >> state;
    const auto port = std::stoul(local.substr(local.find(':') + 1), nullptr, 16);
    if (port == server.port() && state == "0A") {  // 0A = LISTEN
      found = true;
      EXPECT_EQ(local.substr(0, 8), "0100007F") << "bound to " << local;
    }
  }
  EXPECT_TRUE(found) << "listener on port " << server.port() << " not in /proc/net/tcp";
}

// A launcher's listening socket handed to the store (cohortrun's
// COHORT_STORE_FD): a client that connected before the server existed is
// served once it does, and descriptors that are not a TCP listener on the
// port are refused and left open.
TEST(TcpStore, ServesOnAnAdoptedListener) {
  net::Socket held = net::listen_on("127.0.0.1", 0);
  const uint16_t port = net::local_port(held);
  std::thread early([port] {
    TcpStore client("127.0.0.1", port, false, 10s);  // connects into the backlog
    client.set_string("early", "1");
    EXPECT_EQ(client.get_string("late"), "2");
  });
  std::this_thread::sleep_for(100ms);  // let the client connect first
  const int fd = held.release();
  // The wrong port, a pipe, a socket that does not listen: not taken.
  EXPECT_FALSE(net::adopt_listener(fd, static_cast<uint16_t>(port + 1)).valid());
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  EXPECT_FALSE(net::adopt_listener(pipe_fds[0], port).valid());
  EXPECT_NE(::fcntl(pipe_fds[0], F_GETFD), -1) << "a refused descriptor must stay open";
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  net::Socket unlistened(::socket(AF_INET, SOCK_STREAM, 0));
  EXPECT_FALSE(net::adopt_listener(unlistened.fd(), 0).valid());
  EXPECT_NE(::fcntl(fd, F_GETFD), -1);

  net::Socket adopted = net::adopt_listener(fd, port);
  ASSERT_TRUE(adopted.valid());
  EXPECT_EQ(::fcntl(fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  TcpStore server("127.0.0.1", port, true, 10s, "", std::move(adopted));
  EXPECT_EQ(server.port(), port);
  EXPECT_EQ(server.get_string("early"), "1");
  server.set_string("late", "2");
  early.join();
}

TEST(TcpStore, ClientGivesUpWhenNoServerComes) {
  // Find a port nobody listens on: bind, note it, close.
  uint16_t port;
  {
    TcpStore probe("127.0.0.1", 0, true, 1s);
    port = probe.port();
  }
  auto start = std::chrono::steady_clock::now();
  try {
    TcpStore client("127.0.0.1", port, false, 300ms);
    ADD_FAILURE() << "connected to nothing";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}

TEST(PrefixStore, KeepsKeySpacesApart) {
  auto base = std::make_shared<HashStore>();
  PrefixStore a("a", base), b("b", base);
  a.set_string("k", "1");
  b.set_string("k", "2");
  EXPECT_EQ(a.get_string("k"), "1");
  EXPECT_EQ(b.get_string("k"), "2");
  EXPECT_EQ(base->get_string("a/k"), "1");
}

}  // namespace
}  // namespace cohort::store_test
