// The TcpStore server under hostile clients: bad ADD amounts, clients that
// never read, huge frame headers, too many clients, descriptor exhaustion, and
// a bounded fuzz run. Each case asserts that a real client is still served.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <climits>
#include <fstream>
#include <future>
#include <random>
#include <thread>

#include "cohort/core/error.h"
#include "cohort/core/store/tcp_store.h"
#include "cohort/core/store/tcp_store_protocol.h"
#include "cohort/core/store/tcp_store_server.h"

namespace cohort {
namespace {

using namespace std::chrono_literals;
using namespace tcp_store;

net::Socket raw_connect(uint16_t port) {
  return net::connect_to("127.0.0.1", port, net::Clock::now() + 5s);
}

// The server may drop a hostile client mid-send: that is not a failure here.
void send_bytes(const net::Socket& s, const std::vector<uint8_t>& b) {
  try {
    net::send_all(s.fd(), b.data(), b.size());
  } catch (const PeerError&) {
  }
}

// Reads one reply frame: the status byte and the body.
std::pair<uint8_t, std::string> read_reply(const net::Socket& s) {
  uint32_t len = 0;
  net::recv_all(s.fd(), &len, 4, net::Clock::now() + 5s);
  std::string body(len, '\0');
  net::recv_all(s.fd(), body.data(), len, net::Clock::now() + 5s);
  return {static_cast<uint8_t>(body.at(0)), body.substr(1)};
}

// True when the server closed `s` within `within`.
bool closed_by_server(const net::Socket& s, std::chrono::milliseconds within) {
  const auto deadline = net::Clock::now() + within;
  char buf[4096];
  while (net::Clock::now() < deadline) {
    pollfd p{s.fd(), POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    ssize_t k = ::recv(s.fd(), buf, sizeof(buf), 0);
    if (k == 0 || (k < 0 && errno != EINTR && errno != EAGAIN)) return true;
  }
  return false;
}

// A real client's round trip, which every case checks still works.
void expect_served(TcpStore& client, const std::string& tag) {
  client.set_string("probe/" + tag, tag);
  EXPECT_EQ(client.get_string("probe/" + tag), tag);
}

// Destroys the server on another thread; false when that took over `limit`.
bool destroy_within(std::unique_ptr<TcpStoreServer> server, std::chrono::seconds limit) {
  auto done = std::make_shared<std::promise<void>>();
  auto f = done->get_future();
  std::thread([s = std::move(server), done]() mutable {
    s.reset();
    done->set_value();
  }).detach();
  return f.wait_for(limit) == std::future_status::ready;
}

size_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

TEST(TcpStoreHostile, BadAddAmountAnswersAnErrorAndKeepsServing) {
  TcpStore server("127.0.0.1", 0, true, 5s);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  auto raw = raw_connect(server.port());
  for (std::string amount : {"abc", "99999999999999999999", "", "12x", " 1"}) {
    send_bytes(raw, encode_request(kAdd, {"n", amount}));
    auto [status, body] = read_reply(raw);
    EXPECT_EQ(status, kBadRequest) << amount;
    EXPECT_NE(body.find("integer"), std::string::npos) << body;
  }
  // A user's own add() on a key that holds text, and one that overflows.
  client.set_string("text", "hello");
  try {
    client.add("text", 1);
    ADD_FAILURE() << "add on text should fail";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'text'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(client.add("big", INT64_MAX), INT64_MAX);
  EXPECT_THROW(client.add("big", 1), Error);
  EXPECT_EQ(client.add("n", 2), 2);  // the bad amounts left "n" alone
  expect_served(client, "after-bad-add");
}

TEST(TcpStoreHostile, ClientThatNeverReadsIsDroppedAndShutdownIsBounded) {
  TcpStoreServerOptions opt;
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0, opt);
  TcpStore client("127.0.0.1", server->port(), false, 5s);
  auto slow = raw_connect(server->port());
  send_bytes(slow, encode_request(kSet, {"big", std::string(8 << 20, 'x')}));
  std::vector<uint8_t> gets;
  for (int i = 0; i < 40; ++i) {
    auto f = encode_request(kGet, {"big"});
    gets.insert(gets.end(), f.begin(), f.end());
  }
  send_bytes(slow, gets);
  client.set_timeout(3s);
  expect_served(client, "beside-slow-reader");
  EXPECT_TRUE(closed_by_server(slow, 5s)) << "a client over its outbox cap stays connected";
  auto start = net::Clock::now();
  EXPECT_TRUE(destroy_within(std::move(server), 5s)) << "~TcpStoreServer did not return";
  EXPECT_LT(net::Clock::now() - start, 2s);
}

TEST(TcpStoreHostile, HugeFrameHeaderIsRefused) {
  TcpStore server("127.0.0.1", 0, true, 5s);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  auto raw = raw_connect(server.port());
  std::vector<uint8_t> header;
  put_u32(header, 0xFFFFFFFFu);
  header.insert(header.end(), 1000, 0);
  send_bytes(raw, header);
  EXPECT_TRUE(closed_by_server(raw, 3s)) << "a 4 GiB frame header was accepted";
  expect_served(client, "after-huge-header");
  // An honest client is told before anything is sent.
  try {
    client.set("huge", std::vector<uint8_t>(kMaxFrameBytes + 1));
    ADD_FAILURE() << "a value over the frame limit was sent";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("limit"), std::string::npos) << e.what();
  }
  expect_served(client, "after-huge-set");
}

TEST(TcpStoreHostile, ClientsOverTheCapAreRefused) {
  TcpStoreServerOptions opt;
  opt.max_clients = 8;
  TcpStoreServer server("127.0.0.1", 0, opt);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  std::vector<net::Socket> idle;
  for (int i = 0; i < 7; ++i) idle.push_back(raw_connect(server.port()));
  expect_served(client, "at-cap");
  auto extra = raw_connect(server.port());
  EXPECT_TRUE(closed_by_server(extra, 3s)) << "the ninth client was kept";
  idle.clear();
  TcpStore late("127.0.0.1", server.port(), false, 5s);
  expect_served(late, "after-idle-left");
}

// Out of descriptors, accept() fails at once; the server must back off rather
// than spin, and accept again once descriptors are free.
TEST(TcpStoreHostile, OutOfDescriptorsDoesNotSpin) {
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0, TcpStoreServerOptions{});
  TcpStore client("127.0.0.1", server->port(), false, 5s);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  std::vector<net::Socket> held;
  {
    rlimit tight = old;
    tight.rlim_cur = static_cast<rlim_t>(::dup(0));  // the lowest free descriptor
    ::close(static_cast<int>(tight.rlim_cur));
    tight.rlim_cur += 16;
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &tight), 0);
    // Connections the kernel completes but the server cannot accept.
    while (true) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) break;
      held.emplace_back(fd);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(server->port());
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) break;
    }
  }
  // The process's CPU time over 300 ms of sleep on this thread is the server's.
  rusage before{}, after{};
  getrusage(RUSAGE_SELF, &before);
  std::this_thread::sleep_for(300ms);
  getrusage(RUSAGE_SELF, &after);
  auto cpu_us = [](const rusage& r) {
    return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000000L + r.ru_utime.tv_usec +
           r.ru_stime.tv_usec;
  };
  const long used_ms = (cpu_us(after) - cpu_us(before)) / 1000;
  held.clear();
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_LT(used_ms, 100) << "the server spun on accept() while out of descriptors";
  expect_served(client, "after-emfile");
  TcpStore late("127.0.0.1", server->port(), false, 5s);
  expect_served(late, "late-after-emfile");
  EXPECT_TRUE(destroy_within(std::move(server), 5s));
}

// With a token, a client that does not show it is refused and changes nothing.
TEST(TcpStoreHostile, StoreWithATokenRefusesClientsWithout) {
  TcpStore server("127.0.0.1", 0, true, 5s, "secret-token");
  TcpStore client("127.0.0.1", server.port(), false, 5s, "secret-token");
  expect_served(client, "with-token");
  auto raw = raw_connect(server.port());
  send_bytes(raw, encode_request(kSet, {"probe/with-token", "overwritten"}));
  EXPECT_TRUE(closed_by_server(raw, 3s));
  auto big = raw_connect(server.port());  // no large frame before the token
  send_bytes(big, encode_request(kAuth, {std::string(4096, 't')}));
  EXPECT_TRUE(closed_by_server(big, 3s));
  try {
    TcpStore wrong("127.0.0.1", server.port(), false, 2s, "guess");
    ADD_FAILURE() << "a wrong token was accepted";
  } catch (const PeerError& e) {
    EXPECT_NE(std::string(e.what()).find("COHORT_STORE_TOKEN"), std::string::npos) << e.what();
  }
  try {
    TcpStore("127.0.0.1", server.port(), false, 2s).set_string("k", "v");
    ADD_FAILURE() << "a client without the token was served";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("requires the job's token"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(client.get_string("probe/with-token"), "with-token");
}

// Random hostile traffic for a bounded time and count, with small caps, while
// a real client checks after every round that it is served and the values it
// keeps are intact; the process's memory must stay within the caps' bound.
TEST(TcpStoreHostile, FuzzKeepsServingARealClient) {
  TcpStoreServerOptions opt;
  opt.max_frame_bytes = 1 << 20;
  opt.max_outbox_bytes = 2 << 20;
  opt.max_buffered_bytes = 16 << 20;
  opt.max_stored_bytes = 16 << 20;
  opt.max_clients = 64;
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0, opt);
  const uint16_t port = server->port();
  TcpStore client("127.0.0.1", port, false, 5s);
  client.set_timeout(3s);
  const size_t rss_start = rss_bytes();
  std::mt19937 rng(12345);
  auto rand_bytes = [&](size_t n) {
    std::vector<uint8_t> b(n);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    return b;
  };
  std::vector<net::Socket> idle;  // held open, never read
  const auto stop_at = net::Clock::now() + 8s;
  int rounds = 0;
  int64_t counter = 0;
  for (; rounds < 400 && net::Clock::now() < stop_at; ++rounds) {
    auto s = raw_connect(port);
    switch (rng() % 7) {
      case 0: {  // random frame with a truthful length
        auto payload = rand_bytes(rng() % 300);
        std::vector<uint8_t> f;
        put_u32(f, static_cast<uint32_t>(payload.size()));
        f.insert(f.end(), payload.begin(), payload.end());
        send_bytes(s, f);
        break;
      }
      case 1: {  // a truncated frame, then hang up
        auto f = encode_request(kSet, {"k" + std::to_string(rng() % 50), "v"});
        f.resize(rng() % f.size());
        send_bytes(s, f);
        break;
      }
      case 2: {  // a huge or random length header
        std::vector<uint8_t> f;
        put_u32(f, rng() % 2 ? 0xFFFFFFF0u : static_cast<uint32_t>(rng()));
        auto tail = rand_bytes(rng() % 2000);
        f.insert(f.end(), tail.begin(), tail.end());
        send_bytes(s, f);
        break;
      }
      case 3: {  // a slow reader: a large value asked for many times
        send_bytes(s, encode_request(kSet, {"blob", std::string(512 << 10, 'b')}));
        for (int i = 0; i < 20; ++i) send_bytes(s, encode_request(kGet, {"blob"}));
        idle.push_back(std::move(s));
        break;
      }
      case 4:  // an idle client
        idle.push_back(std::move(s));
        break;
      case 5: {  // bad ADD amounts
        const char* bad[] = {"x", "1e3", "-", "999999999999999999999", ""};
        send_bytes(s, encode_request(kAdd, {"counter", bad[rng() % 5]}));
        break;
      }
      default: {  // random SETs of random keys, and WAITs that never complete
        auto key = rand_bytes(rng() % 40);
        send_bytes(s, encode_request(kSet, {std::string(key.begin(), key.end()), "v"}));
        send_bytes(s, encode_request(kWait, {"never/" + std::to_string(rng())}));
        idle.push_back(std::move(s));
        break;
      }
    }
    if (idle.size() > 80) idle.erase(idle.begin(), idle.begin() + 40);
    counter = client.add("counter", 1);
    ASSERT_EQ(counter, rounds + 1) << "round " << rounds;
    expect_served(client, "round");
  }
  EXPECT_GE(rounds, 50) << "too few rounds to mean anything";
  const size_t growth = rss_bytes() > rss_start ? rss_bytes() - rss_start : 0;
  // Caps: 16 MiB buffered + 16 MiB stored, plus allocator slack.
  EXPECT_LT(growth, size_t{96} << 20) << "memory grew by " << (growth >> 20) << " MiB";
  std::cout << "[ fuzz ] " << rounds << " rounds, rss growth " << (growth >> 20) << " MiB\n";
  EXPECT_TRUE(destroy_within(std::move(server), 5s));
}

}  // namespace
}  // namespace cohort
