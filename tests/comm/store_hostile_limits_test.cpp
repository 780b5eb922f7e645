// The TcpStore server's limits under clients that stay within the frame
// limit but hold what they send: parked WAITs (many of them, or on many
// keys), buffers of large frames kept after they were handled, half-sent
// requests and unread replies that fill the shared buffer. Each case checks
// that an honest client is still served, and in time.
#include <dirent.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <thread>

#include "cohort/cohort.h"
#include "cohort/core/error.h"
#include "cohort/core/store/tcp_store.h"
#include "cohort/core/store/tcp_store_protocol.h"
#include "cohort/core/store/tcp_store_server.h"

namespace cohort::store_hostile_limits_test {
namespace {

using namespace std::chrono_literals;
using namespace tcp_store;
using Clock = std::chrono::steady_clock;

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

std::pair<uint8_t, std::string> read_reply(const net::Socket& s, std::chrono::milliseconds within) {
  uint32_t len = 0;
  net::recv_all(s.fd(), &len, 4, net::Clock::now() + within);
  std::string body(len, '\0');
  net::recv_all(s.fd(), body.data(), len, net::Clock::now() + within);
  return {static_cast<uint8_t>(body.at(0)), body.substr(1)};
}

// True when the server closed or reset `s` within `within`, found without
// reading from it (a reset socket polls POLLHUP | POLLERR; a closed one
// POLLRDHUP), so that reading does not drain what the case keeps unread.
bool closed_without_reading(const net::Socket& s, std::chrono::milliseconds within) {
  const auto deadline = Clock::now() + within;
  while (Clock::now() < deadline) {
    pollfd p{s.fd(), POLLRDHUP, 0};
    if (::poll(&p, 1, 50) > 0 && (p.revents & (POLLHUP | POLLERR | POLLRDHUP))) return true;
  }
  return false;
}

size_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * static_cast<size_t>(::sysconf(_SC_PAGESIZE));
}

size_t mib_since(size_t rss_start) {
  const size_t now = rss_bytes();
  return (now > rss_start ? now - rss_start : 0) >> 20;
}

void expect_served(TcpStore& client, const std::string& tag) {
  client.set_string("probe/" + tag, tag);
  EXPECT_EQ(client.get_string("probe/" + tag), tag);
}

// Frames for keys k0..k<n-1>, ready to send in one write.
std::vector<uint8_t> set_frames(int n) {
  std::vector<uint8_t> out;
  for (int i = 0; i < n; ++i) {
    auto f = encode_request(kSet, {"k" + std::to_string(i), ""});
    out.insert(out.end(), f.begin(), f.end());
  }
  return out;
}

std::vector<std::string> keys_k(int n) {
  std::vector<std::string> keys;
  for (int i = 0; i < n; ++i) keys.push_back("k" + std::to_string(i));
  return keys;
}

// The local addresses ("0100007F:1F90", as /proc/net/tcp writes them) of
// this process's listening TCP sockets.
std::multiset<std::string> listening_addresses() {
  std::set<std::string> ours;  // socket inodes
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (auto* e = ::readdir(d)) {
      char target[128] = {0};
      const std::string path = std::string("/proc/self/fd/") + e->d_name;
      if (::readlink(path.c_str(), target, sizeof(target) - 1) > 0 &&
          std::string(target).rfind("socket:[", 0) == 0) {
        ours.insert(std::string(target).substr(8, std::string(target).size() - 9));
      }
    }
    ::closedir(d);
  }
  std::multiset<std::string> addresses;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string f[10];
      for (auto& x : f) fields >> x;
      if (f[3] == "0A" && ours.count(f[9])) addresses.insert(f[1]);
    }
  }
  return addresses;
}

// The longest SET + GET round trip of an honest client while `during` runs;
// an error of the client's is a failure. `during` starts once the client has
// made a round trip, and the client stops only after one more completes, so
// that at least one overlaps `during` however the threads are scheduled.
std::chrono::milliseconds longest_round_trip(uint16_t port, const std::function<void()>& during) {
  TcpStore client("127.0.0.1", port, false, 5s);
  std::atomic<bool> done{false}, failed{false};
  std::atomic<int> trips{0};
  Clock::duration longest{};
  std::string error;
  std::thread honest([&] {
    try {
      while (!done) {
        const auto start = Clock::now();
        client.set_string("honest", std::to_string(trips));
        if (client.get_string("honest") != std::to_string(trips)) error = "a wrong value";
        longest = std::max(longest, Clock::now() - start);
        ++trips;
      }
    } catch (const Error& e) {
      error = e.what();
      failed = true;
    }
  });
  // Each round trip has the client's 5 s timeout; these waits have 15 s.
  auto wait_for_trip_after = [&](int seen) {
    const auto deadline = Clock::now() + 15s;
    while (trips == seen && !failed && Clock::now() < deadline) std::this_thread::yield();
  };
  wait_for_trip_after(0);
  const int before = trips;
  during();
  wait_for_trip_after(before);
  const int after = trips;
  done = true;
  honest.join();
  EXPECT_EQ(error, "");
  EXPECT_GT(after, before) << "no honest round trip ended during or after the requests";
  return std::chrono::duration_cast<std::chrono::milliseconds>(longest);
}

}  // namespace

// A one-host group (the store, and Gloo with its defaults) listens on
// loopback alone: nothing of it can be reached from another machine.
TEST(TcpStoreLimits, OneHostGroupListensOnLoopbackOnly) {
  auto server = std::make_shared<TcpStore>("127.0.0.1", 0, true, 10s);
  std::multiset<std::string> during;
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto store = std::make_shared<TcpStore>("127.0.0.1", server->port(), false, 10s);
        auto comm = connect(store, r, 2);
        auto t = torch::ones({4});
        comm->all_reduce(t).wait();
        comm->barrier().wait();
        if (r == 0) during = listening_addresses();
        comm->barrier().wait();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(errors, (std::vector<std::string>{"", ""}));
  ASSERT_FALSE(during.empty()) << "the store's listener was not found";
  for (const auto& a : during) {
    const std::string host = a.substr(0, a.find(':'));
    EXPECT_TRUE(host == "0100007F" || host == "00000000000000000000000001000000")
        << "listening on " << a << ", not loopback";
  }
  std::cout << "[ loopback ] " << during.size() << " listening sockets, all on loopback\n";
}

// An honest client has one request in flight; one that queues WAITs behind
// a parked WAIT would park without bound. It is closed at the second.
TEST(TcpStoreLimits, PipelinedWaitsBehindAParkedOneCloseTheClient) {
  TcpStoreServerOptions opt;
  opt.max_buffered_bytes = 4 << 20;
  TcpStoreServer server("127.0.0.1", 0, opt);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  const size_t rss_start = rss_bytes();
  auto hostile = raw_connect(server.port());
  std::vector<uint8_t> waits;
  const auto one = encode_request(kWait, {"never"});
  for (int i = 0; i < 1'000'000; ++i) waits.insert(waits.end(), one.begin(), one.end());
  std::thread sender([&] { send_bytes(hostile, waits); });
  const bool closed = closed_without_reading(hostile, 5s);
  ::shutdown(hostile.fd(), SHUT_RDWR);  // ends the send if it still blocks
  sender.join();
  expect_served(client, "after-pipelined-waits");
  const size_t grown = mib_since(rss_start);
  std::cout << "[ waits ] closed " << closed << ", rss growth " << grown << " MiB\n";
  EXPECT_TRUE(closed) << "a client that pipelined WAITs behind a parked one was kept";
  EXPECT_LT(grown, 32u) << "parked WAITs grew the server by " << grown << " MiB";
}

// Parked keys count against the buffer cap: a WAIT on more keys than it
// allows is answered with an error at once, and parks nothing.
TEST(TcpStoreLimits, WaitOnKeysOverTheBufferCapIsRefused) {
  TcpStoreServerOptions opt;
  opt.max_frame_bytes = 1 << 20;
  opt.max_buffered_bytes = 4 << 20;
  TcpStoreServer server("127.0.0.1", 0, opt);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  const size_t rss_start = rss_bytes();
  std::vector<std::string> keys;
  for (int i = 0; i < 60'000; ++i) keys.push_back(std::to_string(i));
  const auto frame = encode_request(kWait, keys);
  std::vector<net::Socket> hostile;
  int refused = 0;
  std::string reason = "no reply within 200 ms";
  for (int c = 0; c < 24; ++c) {
    hostile.push_back(raw_connect(server.port()));
    send_bytes(hostile.back(), frame);
    try {
      auto [status, body] = read_reply(hostile.back(), 200ms);
      refused += status == kBadRequest && body.find("buffer") != std::string::npos;
      reason = body;
    } catch (const Error&) {
    }
  }
  expect_served(client, "beside-wide-waits");
  const size_t grown = mib_since(rss_start);
  std::cout << "[ wide waits ] " << refused << " of 24 refused, rss growth " << grown << " MiB; "
            << reason << "\n";
  EXPECT_EQ(refused, 24) << reason;
  EXPECT_LT(grown, 32u) << "24 WAITs on 60000 keys grew the server by " << grown << " MiB";
}

// A SET must not cost time in proportion to the keys other clients wait on.
TEST(TcpStoreLimits, SetsStayFastBesideParkedWaitsOnManyKeys) {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  constexpr int kKeys = 50'000;
  auto filler = raw_connect(server.port());
  send_bytes(filler, set_frames(kKeys));
  std::vector<uint8_t> replies(5 * kKeys);
  net::recv_all(filler.fd(), replies.data(), replies.size(), net::Clock::now() + 10s);
  auto keys = keys_k(kKeys);
  keys.push_back("missing");
  const auto wait = encode_request(kWait, keys);
  std::vector<net::Socket> waiters;
  for (int c = 0; c < 16; ++c) {
    waiters.push_back(raw_connect(server.port()));
    send_bytes(waiters.back(), wait);
  }
  client.set_timeout(5s);
  // Parking costs in proportion to a WAIT's keys, paid once while its frame
  // arrives (64 KiB a round), mostly within the first 30 SETs' rounds, and
  // under a second in all on a loaded host. A SET that checked every parked
  // key (16 x 50000 lookups, 40-130 ms a SET here) would take 4 s or more
  // for 100 SETs; one that costs the waits on its own key, milliseconds.
  for (int i = 0; i < 30; ++i) client.set_string("early/" + std::to_string(i), "v");
  const auto start = Clock::now();
  for (int i = 0; i < 100; ++i) client.set_string("fast/" + std::to_string(i), "v");
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  std::cout << "[ sets ] 100 SETs beside 16 WAITs on " << kKeys << " keys: " << ms.count()
            << " ms\n";
  EXPECT_LT(ms.count(), 2000);
  // The waits still complete once their last key is set.
  client.set_string("missing", "now");
  for (auto& w : waiters) EXPECT_EQ(read_reply(w, 5s).first, kOk);
}

// Buffers a large request or reply needed are released once it is handled:
// clients that each sent one and idle must not hold them.
TEST(TcpStoreLimits, BuffersOfHandledFramesAreReleased) {
  TcpStoreServerOptions opt;
  opt.max_frame_bytes = 4 << 20;
  opt.max_outbox_bytes = 8 << 20;
  opt.max_buffered_bytes = 16 << 20;
  TcpStoreServer server("127.0.0.1", 0, opt);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  client.set("big", std::vector<uint8_t>(3 << 20, 7));
  const size_t rss_start = rss_bytes();
  std::vector<net::Socket> idle;
  for (int c = 0; c < 24; ++c) {
    idle.push_back(raw_connect(server.port()));
    send_bytes(idle.back(), encode_request(kCheck, {std::string(7 << 19, 'x')}));
    EXPECT_EQ(read_reply(idle.back(), 5s).second, "0");
    send_bytes(idle.back(), encode_request(kGet, {"big"}));
    EXPECT_EQ(read_reply(idle.back(), 5s).second.size(), size_t{3} << 20);
  }
  expect_served(client, "beside-idle-large");
  const size_t grown = mib_since(rss_start);
  std::cout << "[ buffers ] rss growth " << grown << " MiB\n";
  EXPECT_LT(grown, 48u) << "24 idle clients hold " << grown << " MiB after their frames";
}

// Clients that spoke, then sent most of a frame and went quiet, hold the
// shared buffer: an honest request must still be served, at once, and the
// quiet ones closed after the stall timeout.
TEST(TcpStoreLimits, HalfSentRequestsDoNotLockOutHonestClients) {
  TcpStoreServerOptions opt;
  opt.max_frame_bytes = 1 << 20;
  opt.max_buffered_bytes = 4 << 20;
  opt.stall_timeout = 1s;
  TcpStoreServer server("127.0.0.1", 0, opt);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  client.set_timeout(2s);
  std::vector<net::Socket> hogs;
  for (int c = 0; c < 4; ++c) {
    hogs.push_back(raw_connect(server.port()));
    send_bytes(hogs.back(), encode_request(kCheck, {"x"}));
    read_reply(hogs.back(), 5s);
    std::vector<uint8_t> part;
    put_u32(part, 1 << 20);
    part.resize((4 << 18) - 16, 'h');  // the four together: 64 bytes under the cap
    send_bytes(hogs.back(), part);
  }
  int failures = 0;
  std::string first_error;
  for (int i = 0; i < 20; ++i) {
    try {
      client.set("honest", std::vector<uint8_t>(4096, 1));
      EXPECT_EQ(client.get("honest").size(), 4096u);
    } catch (const Error& e) {
      if (failures++ == 0) first_error = e.what();
    }
  }
  std::cout << "[ half-sent ] " << failures << " of 20 honest requests failed " << first_error
            << "\n";
  EXPECT_EQ(failures, 0) << first_error;
  EXPECT_TRUE(closed_without_reading(hogs.back(), 5s)) << "a stalled half-sent request was kept";
}

// A client that leaves a large reply unread is closed after the stall timeout.
TEST(TcpStoreLimits, UnreadReplyIsClosedAfterTheStallTimeout) {
  TcpStoreServerOptions opt;
  opt.stall_timeout = 1s;
  TcpStoreServer server("127.0.0.1", 0, opt);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  client.set("big", std::vector<uint8_t>(15 << 20, 3));
  auto slow = raw_connect(server.port());
  send_bytes(slow, encode_request(kGet, {"big"}));
  const auto start = Clock::now();
  const bool closed = closed_without_reading(slow, 5s);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  std::cout << "[ unread ] closed " << closed << " after " << ms.count() << " ms\n";
  EXPECT_TRUE(closed) << "a client that never read its 15 MiB reply was kept";
  expect_served(client, "after-unread");
}

// One request naming a million keys (a WAIT on distinct ones, indexed one by
// one when parked; a CHECK on one key over and over) is refused with an error
// naming the limit, and the loop keeps serving an honest client meanwhile.
TEST(TcpStoreLimits, HugeKeyListsAreRefusedWithoutStallingOthers) {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore setter("127.0.0.1", server.port(), false, 5s);
  setter.set_string("a", "1");
  std::vector<std::string> distinct;
  for (int i = 0; i < 1'300'000; ++i) distinct.push_back("w" + std::to_string(i));
  const std::pair<const char*, std::vector<uint8_t>> requests[] = {
      {"WAIT on 1300000 distinct keys", encode_request(kWait, distinct)},
      {"CHECK on 3300000 x 'a'", encode_request(kCheck, std::vector<std::string>(3'300'000, "a"))},
  };
  for (const auto& [what, frame] : requests) {
    ASSERT_LE(frame.size() - 4, kMaxFrameBytes) << what;
    auto hostile = raw_connect(server.port());
    std::pair<uint8_t, std::string> answer{kOk, "no reply within 3 s"};
    const auto longest = longest_round_trip(server.port(), [&] {
      send_bytes(hostile, frame);
      try {
        answer = read_reply(hostile, 3s);
      } catch (const Error&) {
      }
    });
    std::cout << "[ huge key list ] " << what << ": " << answer.second
              << "; longest honest round trip " << longest.count() << " ms\n";
    EXPECT_EQ(answer.first, kBadRequest) << what;
    EXPECT_NE(answer.second.find(std::to_string(kMaxKeysPerRequest) + " keys per request"),
              std::string::npos)
        << answer.second;
    // Parking or checking them took the loop 1-2 s; refusing them, a scan of the frame.
    EXPECT_LT(longest.count(), 400) << what;
  }
}

// Requests at the limit are cheap enough: honest round trips stay short
// while 16 clients each park a WAIT on kMaxKeysPerRequest distinct keys.
TEST(TcpStoreLimits, WaitsAtTheKeyLimitKeepOthersServed) {
  TcpStoreServer server("127.0.0.1", 0);
  std::vector<std::vector<uint8_t>> frames;
  for (int c = 0; c < 16; ++c) {
    std::vector<std::string> keys;
    for (size_t i = 0; i < kMaxKeysPerRequest; ++i) {
      keys.push_back("c" + std::to_string(c) + "/" + std::to_string(i));
    }
    frames.push_back(encode_request(kWait, keys));
  }
  std::vector<net::Socket> waiters;
  const auto longest = longest_round_trip(server.port(), [&] {
    for (const auto& frame : frames) {
      waiters.push_back(raw_connect(server.port()));
      send_bytes(waiters.back(), frame);
    }
  });
  std::cout << "[ waits at the limit ] 16 WAITs on " << kMaxKeysPerRequest
            << " keys: longest honest round trip " << longest.count() << " ms\n";
  EXPECT_LT(longest.count(), 400);
  // They were parked, not refused: the first is answered once its keys are set.
  auto setter = raw_connect(server.port());
  std::vector<uint8_t> sets;
  for (size_t i = 0; i < kMaxKeysPerRequest; ++i) {
    auto f = encode_request(kSet, {"c0/" + std::to_string(i), ""});
    sets.insert(sets.end(), f.begin(), f.end());
  }
  send_bytes(setter, sets);
  std::vector<uint8_t> replies(5 * kMaxKeysPerRequest);
  net::recv_all(setter.fd(), replies.data(), replies.size(), net::Clock::now() + 10s);
  EXPECT_EQ(read_reply(waiters[0], 5s).first, kOk);
}

// TcpStore sends a longer list in slices the server takes: check() and
// wait() on 2 x kMaxKeysPerRequest + 1 keys answer as on one slice.
TEST(TcpStoreLimits, LongKeyListsGoInSlices) {
  TcpStoreServer server("127.0.0.1", 0);
  const int n = static_cast<int>(2 * kMaxKeysPerRequest + 1);
  auto filler = raw_connect(server.port());
  send_bytes(filler, set_frames(n));
  std::vector<uint8_t> replies(5 * static_cast<size_t>(n));
  net::recv_all(filler.fd(), replies.data(), replies.size(), net::Clock::now() + 10s);
  TcpStore client("127.0.0.1", server.port(), false, 5s);
  auto keys = keys_k(n);
  EXPECT_TRUE(client.check(keys));
  client.wait(keys, 5s);
  keys.push_back("missing");  // in the third slice
  EXPECT_FALSE(client.check(keys));
  std::thread late([&] {
    TcpStore other("127.0.0.1", server.port(), false, 5s);
    other.set_string("missing", "now");
  });
  client.wait(keys, 5s);
  late.join();
  EXPECT_TRUE(client.check(keys));
}

}  // namespace cohort::store_hostile_limits_test
