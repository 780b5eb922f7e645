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

#include "cohort/cohort.h"
#include "cohort/core/error.h"
#include "cohort/core/store/tcp_store.h"
#include "cohort/core/store/tcp_store_protocol.h"
#include "cohort/core/store/tcp_store_server.h"
#include "support/subprocess.h"

namespace cohort::store_hostile_test {
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

// True when the server reset `s` within `within`, found without reading
// from it: a client that reads would drain the outbox whose growth is
// what gets a non-reading client dropped. (drop() resets the connection, and
// a reset socket polls POLLHUP | POLLERR whatever is left in its buffer.)
bool reset_without_reading(const net::Socket& s, std::chrono::milliseconds within) {
  const auto deadline = net::Clock::now() + within;
  while (net::Clock::now() < deadline) {
    pollfd p{s.fd(), 0, 0};
    if (::poll(&p, 1, 50) > 0 && (p.revents & (POLLHUP | POLLERR))) return true;
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
  // 40 replies of 8 MiB against a 32 MiB outbox cap: only a client that
  // reads could stay, and this one never does.
  EXPECT_TRUE(reset_without_reading(slow, 20s)) << "a client over its outbox cap stays connected";
  EXPECT_TRUE(destroy_within(std::move(server), 5s)) << "~TcpStoreServer did not return";
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

// At the cap, a new connection takes the place of the oldest one that has
// said nothing; when every client has spoken, it is refused.
TEST(TcpStoreHostile, ClientsOverTheCapEvictSilentOnesOrAreRefused) {
  TcpStoreServerOptions opt;
  opt.max_clients = 8;
  opt.handshake_timeout = std::chrono::minutes(5);  // no expiry in this case
  TcpStoreServer server("127.0.0.1", 0, opt);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  std::vector<net::Socket> idle;
  for (int i = 0; i < 7; ++i) idle.push_back(raw_connect(server.port()));
  expect_served(client, "at-cap");
  auto extra = raw_connect(server.port());
  EXPECT_TRUE(closed_by_server(idle[0], 5s)) << "the oldest silent client was kept at the cap";
  expect_served(client, "after-eviction");
  // Speaking clients fill the cap: the next connection is closed at once.
  idle.clear();
  extra = net::Socket();
  std::vector<std::unique_ptr<TcpStore>> talking;
  for (int tries = 0; talking.size() < 7 && tries < 50; ++tries) {
    try {
      talking.push_back(std::make_unique<TcpStore>("127.0.0.1", server.port(), false, 5s));
    } catch (const PeerError&) {
      // a silent socket freed above may not have been closed yet: retry
    }
  }
  ASSERT_EQ(talking.size(), 7u);
  auto ninth = raw_connect(server.port());
  EXPECT_TRUE(closed_by_server(ninth, 5s)) << "a ninth client was kept beside 8 that spoke";
  for (auto& t : talking) expect_served(*t, "talking");
}

// A connection that sends no complete frame within the handshake deadline is
// closed; one that spoke stays however long it idles after.
TEST(TcpStoreHostile, SilentClientsAreClosedAfterTheHandshakeDeadline) {
  TcpStoreServerOptions opt;
  opt.handshake_timeout = 2s;
  TcpStoreServer server("127.0.0.1", 0, opt);
  auto silent = raw_connect(server.port());
  auto partial = raw_connect(server.port());
  auto f = encode_request(kSet, {"k", "v"});
  f.resize(f.size() - 1);  // never completed
  send_bytes(partial, f);
  auto spoke = raw_connect(server.port());
  send_bytes(spoke, encode_request(kCheck, {"k"}));
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  EXPECT_TRUE(closed_by_server(silent, 20s)) << "a silent client outlived the deadline";
  EXPECT_TRUE(closed_by_server(partial, 20s)) << "a half-sent frame outlived the deadline";
  EXPECT_EQ(read_reply(spoke).first, kOk);
  // A silent witness accepted after `client` and `spoke`: once it is closed,
  // their deadlines have passed too, and they must still be served.
  auto witness = raw_connect(server.port());
  EXPECT_TRUE(closed_by_server(witness, 20s));
  expect_served(client, "after-deadline");
  send_bytes(spoke, encode_request(kCheck, {"probe/after-deadline"}));
  EXPECT_EQ(read_reply(spoke).second, "1") << "a client that spoke was closed";
}

// Restores the process's descriptor limit when the test ends, however it ends.
class NofileGuard {
 public:
  NofileGuard() { ::getrlimit(RLIMIT_NOFILE, &old_); }
  ~NofileGuard() { ::setrlimit(RLIMIT_NOFILE, &old_); }
  const rlimit& old() const { return old_; }

 private:
  rlimit old_{};
};

// Opens argv[2] connections to 127.0.0.1:argv[1], says "ready", and holds
// them without sending a byte.
constexpr const char* kSilentFlood = R"(
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # inherited from the test's tight limit
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(int(sys.argv[2]))]
print("ready", flush=True)
time.sleep(120)
)";

// Rank 0 may open 256 descriptors and another process holds 300 silent
// connections to its store: a two-rank job still rendezvouses over that
// store, connects (which needs descriptors of rank 0's own) and reduces.
TEST(TcpStoreHostile, SilentFloodUnderADescriptorLimitDoesNotStopTheJob) {
  NofileGuard guard;
  rlimit tight = guard.old();
  const int lowest_free = ::dup(0);
  ::close(lowest_free);
  tight.rlim_cur = static_cast<rlim_t>(std::max(256, lowest_free + 192));
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0, TcpStoreServerOptions{});
  const uint16_t port = server->port();
  testing::Subprocess flood({"/usr/bin/python3", "-c", kSilentFlood, std::to_string(port), "300"});
  ASSERT_TRUE(flood.wait_for_stdout("ready", 1, testing::Seconds(60)))
      << flood.finish(testing::Seconds(1)).err;
  std::vector<float> got(2, -1);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto store = std::make_shared<TcpStore>("127.0.0.1", port, false, 20s);
        ConnectOptions o;
        o.timeout = 20s;
        auto comm = connect(store, r, 2, o);
        auto t = torch::full({3}, static_cast<float>(r + 1));
        comm->all_reduce(t).wait();
        got[static_cast<size_t>(r)] = t[0].item<float>();
        comm->barrier().wait();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
  EXPECT_EQ(got, (std::vector<float>{3, 3}));
  EXPECT_TRUE(destroy_within(std::move(server), 5s));
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

// Random hostile traffic for a fixed count of rounds, with small caps, while
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
  client.set_timeout(10s);
  const size_t rss_start = rss_bytes();
  std::mt19937 rng(12345);
  auto rand_bytes = [&](size_t n) {
    std::vector<uint8_t> b(n);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    return b;
  };
  std::vector<net::Socket> idle;  // held open, never read
  int rounds = 0;
  int64_t counter = 0;
  for (; rounds < 200; ++rounds) {
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
  const size_t growth = rss_bytes() > rss_start ? rss_bytes() - rss_start : 0;
  // Caps: 16 MiB buffered + 16 MiB stored, plus allocator slack.
  EXPECT_LT(growth, size_t{96} << 20) << "memory grew by " << (growth >> 20) << " MiB";
  std::cout << "[ fuzz ] " << rounds << " rounds, rss growth " << (growth >> 20) << " MiB\n";
  EXPECT_TRUE(destroy_within(std::move(server), 5s));
}

}  // namespace
}  // namespace cohort::store_hostile_test
