#include "cohort/core/store/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>

#include "cohort/core/error.h"

namespace cohort::net {

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    close();
    fd_ = o.release();
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* a) const { freeaddrinfo(a); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoDeleter>;

AddrInfo resolve(const std::string& host, uint16_t port, int flags) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    throw ConfigError("cannot resolve address '" + host + "': " + gai_strerror(rc));
  }
  return AddrInfo(res);
}

std::string endpoint(const std::string& host, uint16_t port) {
  return host + ":" + std::to_string(port);
}

}  // namespace

Socket listen_on(const std::string& host, uint16_t port) {
  auto addrs = resolve(host, port, AI_PASSIVE);
  std::string last_error = "no address";
  for (addrinfo* a = addrs.get(); a; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (!s.valid()) continue;
    int one = 1;
    setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) == 0 && ::listen(s.fd(), 1024) == 0) {
      return s;
    }
    last_error = std::strerror(errno);
  }
  throw ConfigError("cannot listen on " + endpoint(host, port) + ": " + last_error);
}

uint16_t local_port(const Socket& s) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(s.fd(), reinterpret_cast<sockaddr*>(&ss), &len);
  if (ss.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  }
  return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

Socket adopt_listener(int fd, uint16_t port) {
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return Socket();
  auto option = [fd](int name) {
    int value = -1;
    socklen_t len = sizeof(value);
    return ::getsockopt(fd, SOL_SOCKET, name, &value, &len) == 0 ? value : -1;
  };
  const int domain = option(SO_DOMAIN);
  if ((domain != AF_INET && domain != AF_INET6) || option(SO_TYPE) != SOCK_STREAM ||
      option(SO_ACCEPTCONN) != 1) {
    return Socket();
  }
  Socket s(fd);
  if (local_port(s) != port) {
    s.release();
    return Socket();
  }
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  return s;
}

Socket connect_to(const std::string& host, uint16_t port, Clock::time_point deadline) {
  auto backoff = std::chrono::milliseconds(5);
  std::string last_error;
  while (true) {
    auto addrs = resolve(host, port, 0);
    for (addrinfo* a = addrs.get(); a; a = a->ai_next) {
      Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!s.valid()) continue;
      if (::connect(s.fd(), a->ai_addr, a->ai_addrlen) == 0) {
        int one = 1;
        setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return s;
      }
      last_error = std::strerror(errno);
    }
    if (Clock::now() + backoff > deadline) {
      throw TimeoutError("could not connect to " + endpoint(host, port) +
                         " before the timeout (last error: " + last_error + ")");
    }
    // The listener may not be up yet: retry, backing off to 200 ms.
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

void send_all(int fd, const void* data, size_t n) {
  auto p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw PeerError(std::string("send failed: ") + std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  auto p = static_cast<char*>(data);
  while (n > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) throw TimeoutError("no reply before the timeout");
    pollfd pfd{fd, POLLIN, 0};
    int rc = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30)));
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0) continue;  // re-check the deadline
    ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) throw PeerError("connection closed by the other side");
    if (k < 0) throw PeerError(std::string("recv failed: ") + std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
  }
}

std::string source_address_for(const std::string& host) {
  auto addrs = resolve(host, 9, 0);
  for (addrinfo* a = addrs.get(); a; a = a->ai_next) {
    // A UDP "connect" only picks the route; nothing goes on the wire.
    Socket s(::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (!s.valid() || ::connect(s.fd(), a->ai_addr, a->ai_addrlen) != 0) continue;
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    if (getsockname(s.fd(), reinterpret_cast<sockaddr*>(&ss), &len) != 0) continue;
    char buf[INET6_ADDRSTRLEN] = {};
    const void* addr =
        ss.ss_family == AF_INET6
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&ss)->sin_addr);
    if (inet_ntop(ss.ss_family, addr, buf, sizeof(buf))) return buf;
  }
  throw ConfigError("no route to " + host + " from this host");
}

bool is_loopback(const std::string& host) {
  if (host == "localhost" || host == "::1") return true;
  return host.rfind("127.", 0) == 0;
}

}  // namespace cohort::net
