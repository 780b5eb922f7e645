#include "cohort/core/store/tcp_store_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <utility>

#include "cohort/core/error.h"
#include "cohort/core/store/tcp_store_protocol.h"

namespace cohort {

using namespace tcp_store;

namespace {

constexpr auto kAcceptPause = std::chrono::milliseconds(100);
// What a parked WAIT's key costs beside its bytes: its string in the waiter
// and its node in the key's watcher set (an estimate on the high side).
constexpr size_t kWatchBytes = 160;

// A decimal int64 with nothing around it; false otherwise (no exceptions:
// the text comes from any client).
bool parse_int64(const std::string& s, int64_t& out) {
  if (s.empty() || s.size() > 20) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size() || std::isspace(static_cast<unsigned char>(s[0]))) {
    return false;
  }
  out = v;
  return true;
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

// max_clients, and no more than half the descriptors this process may open:
// silent connections must not take the ones the rank needs itself.
size_t client_cap(size_t max_clients) {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return max_clients;
  return std::max<size_t>(1, std::min<size_t>(max_clients, r.rlim_cur / 2));
}

// A buffer keeps its capacity after a large frame passed through it: give
// that back once little of it is used, so idle clients hold no memory.
void trim(std::vector<uint8_t>& b) {
  if (b.capacity() > (size_t{64} << 10) && b.capacity() > 4 * b.size()) b.shrink_to_fit();
}

int ms_until(std::chrono::steady_clock::time_point t, std::chrono::steady_clock::time_point now) {
  return static_cast<int>(
      std::max<int64_t>(0, std::chrono::ceil<std::chrono::milliseconds>(t - now).count()));
}

}  // namespace

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port,
                               TcpStoreServerOptions options)
    : TcpStoreServer(net::listen_on(host, port), std::move(options)) {}

TcpStoreServer::TcpStoreServer(net::Socket listener, TcpStoreServerOptions options)
    : opt_(std::move(options)),
      client_cap_(client_cap(opt_.max_clients)),
      listener_(std::move(listener)),
      port_(net::local_port(listener_)) {
  set_nonblocking(listener_.fd());
  if (::pipe2(stop_pipe_, O_CLOEXEC) != 0) {
    throw Error(std::string("TcpStoreServer: pipe failed: ") + std::strerror(errno));
  }
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::~TcpStoreServer() {
  char b = 0;
  (void)!::write(stop_pipe_[1], &b, 1);
  thread_.join();
  // The listener first: a client that sees its connection close must find
  // no listener left here (cohort::finalize() relies on it).
  listener_.close();
  clients_.clear();
  ::close(stop_pipe_[0]);
  ::close(stop_pipe_[1]);
}

void TcpStoreServer::run() {
  std::vector<pollfd> fds;
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    const bool accepting = now >= accept_paused_until_;
    fds.clear();
    fds.push_back({stop_pipe_[0], POLLIN, 0});
    fds.push_back({accepting ? listener_.fd() : -1, POLLIN, 0});
    for (auto& [fd, c] : clients_) {
      const bool pending = c.sent < c.outbox.size();
      fds.push_back({fd, static_cast<short>(POLLIN | (pending ? POLLOUT : 0)), 0});
    }
    int timeout_ms = expire_silent(now);
    if (!accepting) {
      const int pause = ms_until(accept_paused_until_, now);
      timeout_ms = timeout_ms < 0 ? pause : std::min(timeout_ms, pause);
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents) return;
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      auto it = clients_.find(fds[i].fd);
      if (it == clients_.end() || it->second.dropped) continue;
      if (fds[i].revents & POLLOUT) flush(it->second);
      if (!it->second.dropped && (fds[i].revents & (POLLIN | POLLHUP | POLLERR))) {
        read_client(it->second);
      }
    }
    // What a client sent before its deadline has been read just above.
    expire_silent(std::chrono::steady_clock::now());
    // Erase dropped clients only here: handlers reach other clients (waiters).
    for (auto it = clients_.begin(); it != clients_.end();) {
      it = it->second.dropped ? clients_.erase(it) : std::next(it);
    }
    // Last, so that a descriptor freed by an eviction and reused by accept()
    // is never mistaken for the old client in `fds`.
    if (fds[1].revents & POLLIN) accept_clients();
  }
}

int TcpStoreServer::expire_silent(std::chrono::steady_clock::time_point now) {
  int next_ms = -1;
  for (auto& [fd, c] : clients_) {
    if (c.dropped) continue;
    // Silent: no frame yet. Stalled: half a request in, or a reply not read.
    const bool stalled = !c.inbox.empty() || c.sent < c.outbox.size();
    if (c.spoke && !stalled) continue;
    const auto deadline =
        c.spoke ? c.progress_at + opt_.stall_timeout : c.accepted_at + opt_.handshake_timeout;
    if (deadline <= now) {
      drop(c);
    } else {
      const int ms = ms_until(deadline, now);
      next_ms = next_ms < 0 ? ms : std::min(next_ms, ms);
    }
  }
  return next_ms;
}

bool TcpStoreServer::evict_oldest_silent() {
  auto oldest = clients_.end();
  for (auto it = clients_.begin(); it != clients_.end(); ++it) {
    if (it->second.spoke || it->second.dropped) continue;
    if (oldest == clients_.end() || it->second.accepted_at < oldest->second.accepted_at) {
      oldest = it;
    }
  }
  if (oldest == clients_.end()) return false;
  drop(oldest->second);
  clients_.erase(oldest);  // closes the descriptor now
  return true;
}

void TcpStoreServer::accept_clients() {
  // Bounded, so that a flood of connections cannot starve the clients.
  for (int n = 0; n < 64; ++n) {
    int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // Silent connections must not lock real clients out: free one.
        if (evict_oldest_silent()) continue;
        // The connection stays in the backlog; try again once descriptors
        // may have been freed rather than spin on a listener that stays
        // readable.
        accept_paused_until_ = std::chrono::steady_clock::now() + kAcceptPause;
      }
      return;  // EAGAIN, or a connection aborted before accept
    }
    if (clients_.size() >= client_cap_ && !evict_oldest_silent()) {
      ::close(fd);
      continue;
    }
    Client& c = clients_[fd];
    c.sock = net::Socket(fd);
    c.accepted_at = c.progress_at = std::chrono::steady_clock::now();
    c.authenticated = opt_.token.empty();
  }
}

void TcpStoreServer::drop(Client& c) {
  if (c.dropped) return;
  unpark(c);
  c.dropped = true;
  const int fd = c.sock.fd();
  // Reset rather than close: the kernel then discards what is still queued
  // for a client that does not read, instead of holding it for it.
  linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
  buffered_bytes_ -= c.inbox.size() + c.outbox.size();
  c.inbox = {};
  c.outbox = {};
  c.sent = 0;
}

bool TcpStoreServer::make_room(const Client& c, size_t bytes) {
  while (buffered_bytes_ + bytes > opt_.max_buffered_bytes) {
    Client* largest = nullptr;
    for (auto& [fd, other] : clients_) {
      if (&other == &c || other.dropped) continue;
      if (!largest || other.held() > largest->held()) largest = &other;
    }
    // The client that would hold the most is the one to refuse.
    if (!largest || largest->held() <= c.held() + bytes) return false;
    drop(*largest);
  }
  return true;
}

void TcpStoreServer::read_client(Client& c) {
  uint8_t buf[65536];
  ssize_t k = ::recv(c.sock.fd(), buf, sizeof(buf), 0);
  if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
  if (k <= 0 || !make_room(c, static_cast<size_t>(k))) return drop(c);
  c.progress_at = std::chrono::steady_clock::now();
  c.inbox.insert(c.inbox.end(), buf, buf + k);
  buffered_bytes_ += static_cast<size_t>(k);
  // Handle every complete frame in the inbox.
  size_t pos = 0;
  while (!c.dropped && c.inbox.size() - pos >= 4) {
    uint32_t len;
    std::memcpy(&len, c.inbox.data() + pos, 4);
    if (len > (c.authenticated ? opt_.max_frame_bytes : kMaxUnauthenticatedFrameBytes)) {
      return drop(c);
    }
    if (c.inbox.size() - pos - 4 < len) break;
    // A request behind a parked WAIT breaks one-request-at-a-time, and
    // would park without bound.
    if (c.parked) return drop(c);
    const uint8_t* payload = c.inbox.data() + pos + 4;
    // Counted before a string is built: the work a request makes the loop
    // do grows with its keys, and their number comes from the client.
    const size_t n_args = count_args(payload, len, kMaxKeysPerRequest);
    uint8_t cmd = 0;
    std::vector<std::string> args;
    if (n_args <= kMaxKeysPerRequest && !decode_request(payload, len, cmd, args)) return drop(c);
    pos += 4 + len;
    c.spoke = true;
    if (n_args > kMaxKeysPerRequest) {
      reply(c, kBadRequest,
            "a request of more than " + std::to_string(kMaxKeysPerRequest) +
                " keys is over the server's limit of " + std::to_string(kMaxKeysPerRequest) +
                " keys per request");
      continue;
    }
    handle(c, cmd, args);
  }
  if (c.dropped) return;
  c.inbox.erase(c.inbox.begin(), c.inbox.begin() + static_cast<long>(pos));
  buffered_bytes_ -= pos;
  trim(c.inbox);
}

void TcpStoreServer::flush(Client& c) {
  while (c.sent < c.outbox.size()) {
    ssize_t k = ::send(c.sock.fd(), c.outbox.data() + c.sent, c.outbox.size() - c.sent,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (k <= 0) return drop(c);
    c.sent += static_cast<size_t>(k);
    c.progress_at = std::chrono::steady_clock::now();
  }
  // Release what was sent once it is all of it or a good part of it.
  if (c.sent == c.outbox.size() || c.sent >= (size_t{1} << 20)) {
    c.outbox.erase(c.outbox.begin(), c.outbox.begin() + static_cast<long>(c.sent));
    buffered_bytes_ -= c.sent;
    c.sent = 0;
    trim(c.outbox);
  }
}

bool TcpStoreServer::has_all(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(),
                     [&](const std::string& k) { return data_.count(k) > 0; });
}

// Compares in time independent of where the strings differ.
static bool same_token(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

void TcpStoreServer::authenticate(Client& c, uint8_t cmd, const std::vector<std::string>& args) {
  if (cmd == kAuth && args.size() == 1 && same_token(args[0], opt_.token)) {
    c.authenticated = true;
    return reply(c, kOk);
  }
  // The reply goes out at once (the outbox of a new client is empty).
  reply(c, kBadRequest,
        "this store requires the job's token (COHORT_STORE_TOKEN); the request did not "
        "carry it");
  drop(c);
}

void TcpStoreServer::handle(Client& c, uint8_t cmd, const std::vector<std::string>& args) {
  if (!c.authenticated) return authenticate(c, cmd, args);
  switch (cmd) {
    case kSet:
      if (args.size() != 2) break;
      store_value(c, args[0], args[1], /*echo=*/false);
      return;
    case kGet: {
      if (args.size() != 1) break;
      auto it = data_.find(args[0]);
      if (it == data_.end()) {
        reply(c, kNotFound);
      } else {
        reply(c, kOk, it->second);
      }
      return;
    }
    case kAdd:
      if (args.size() != 2) break;
      handle_add(c, args);
      return;
    case kCheck:
      reply(c, kOk, has_all(args) ? "1" : "0");
      return;
    case kWait:
      park(c, args);
      return;
    case kAuth:  // already authenticated, or no token required
      reply(c, kOk);
      return;
    case kDelete: {
      if (args.size() != 1) break;
      auto it = data_.find(args[0]);
      const bool found = it != data_.end();
      if (found) {
        stored_bytes_ -= it->first.size() + it->second.size();
        data_.erase(it);
      }
      reply(c, kOk, found ? "1" : "0");
      if (found) key_changed(args[0], /*added=*/false);
      return;
    }
    default:
      break;
  }
  reply(c, kBadRequest, "unknown command or wrong number of arguments");
}

void TcpStoreServer::handle_add(Client& c, const std::vector<std::string>& args) {
  const std::string& key = args[0];
  int64_t delta = 0, current = 0, sum = 0;
  if (!parse_int64(args[1], delta)) {
    return reply(c, kBadRequest, "ADD amount is not an int64 integer");
  }
  auto it = data_.find(key);
  if (it != data_.end() && !parse_int64(it->second, current)) {
    return reply(c, kBadRequest, "ADD on key '" + key + "', whose value is not an integer");
  }
  if (__builtin_add_overflow(current, delta, &sum)) {
    return reply(c, kBadRequest, "ADD on key '" + key + "' overflows int64 integer");
  }
  store_value(c, key, std::to_string(sum), /*echo=*/true);
}

// Stores key=value, answers (with the new value when `echo`, as ADD returns
// it) and wakes the waiters it completes.
void TcpStoreServer::store_value(Client& c, const std::string& key, std::string value, bool echo) {
  auto it = data_.find(key);
  const bool added = it == data_.end();
  const size_t old_bytes = added ? 0 : key.size() + it->second.size();
  const size_t new_bytes = key.size() + value.size();
  if (stored_bytes_ - old_bytes + new_bytes > opt_.max_stored_bytes) {
    return reply(c, kBadRequest,
                 "the store is full (" + std::to_string(opt_.max_stored_bytes) + " bytes)");
  }
  stored_bytes_ = stored_bytes_ - old_bytes + new_bytes;
  auto& slot = data_[key];
  slot = std::move(value);
  reply(c, kOk, echo ? slot : std::string());
  if (added) key_changed(key, /*added=*/true);
}

void TcpStoreServer::reply(Client& c, uint8_t status, const std::string& body) {
  if (c.dropped) return;
  const size_t frame = 5 + body.size();
  if (c.outbox.size() + frame > opt_.max_outbox_bytes || !make_room(c, frame)) {
    return drop(c);  // it has not read what it asked for
  }
  put_u32(c.outbox, static_cast<uint32_t>(1 + body.size()));
  c.outbox.push_back(status);
  c.outbox.insert(c.outbox.end(), body.begin(), body.end());
  buffered_bytes_ += frame;
  flush(c);
}

void TcpStoreServer::park(Client& c, const std::vector<std::string>& args) {
  if (has_all(args)) return reply(c, kOk);
  // Costed before anything is built: the key count comes from the client.
  size_t cost = 0;
  for (auto& k : args) cost += k.size() + kWatchBytes;
  if (cost > opt_.max_buffered_bytes || !make_room(c, cost)) {
    return reply(c, kBadRequest,
                 "WAIT on " + std::to_string(args.size()) + " keys needs about " +
                     std::to_string(cost) + " bytes of the server's buffer, over its limit of " +
                     std::to_string(opt_.max_buffered_bytes) + " bytes");
  }
  const int fd = c.sock.fd();
  Waiter w;
  for (auto& k : args) {
    if (!watchers_[k].insert(fd).second) continue;  // named twice
    w.keys.push_back(k);
    w.missing += data_.count(k) == 0;
  }
  waiters_[fd] = std::move(w);
  c.parked = true;
  c.parked_bytes = cost;
  buffered_bytes_ += cost;
}

void TcpStoreServer::unpark(Client& c) {
  if (!c.parked) return;
  auto w = waiters_.find(c.sock.fd());
  for (auto& k : w->second.keys) {
    auto it = watchers_.find(k);
    it->second.erase(c.sock.fd());
    if (it->second.empty()) watchers_.erase(it);
  }
  waiters_.erase(w);
  buffered_bytes_ -= c.parked_bytes;
  c.parked_bytes = 0;
  c.parked = false;
}

void TcpStoreServer::key_changed(const std::string& key, bool added) {
  auto it = watchers_.find(key);
  if (it == watchers_.end()) return;
  // Answering unparks, which edits watchers_: collect first.
  std::vector<int> ready;
  for (int fd : it->second) {
    auto& w = waiters_.at(fd);
    w.missing = added ? w.missing - 1 : w.missing + 1;
    if (w.missing == 0) ready.push_back(fd);
  }
  for (int fd : ready) {
    Client& c = clients_.at(fd);
    unpark(c);
    reply(c, kOk);
  }
}

}  // namespace cohort
