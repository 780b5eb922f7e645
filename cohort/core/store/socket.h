// defines: Socket (an owned TCP file descriptor) and the few blocking helpers
// the TcpStore needs, each with a deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace cohort::net {

using Clock = std::chrono::steady_clock;

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& o) noexcept : fd_(o.release()) {}
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() { close(); }

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void close();

 private:
  int fd_ = -1;
};

/// Listens on host:port (port 0 picks a free one). Binds only the address
/// given: a loopback host listens on loopback alone.
Socket listen_on(const std::string& host, uint16_t port);
uint16_t local_port(const Socket& s);

/// Takes `fd` when it is a TCP socket already listening on `port` (a
/// launcher bound it and handed it over, so that no other process could take
/// the port in between), setting close-on-exec; an invalid Socket, with `fd`
/// left alone, otherwise.
Socket adopt_listener(int fd, uint16_t port);

/// Connects to host:port, retrying refused connections until `deadline`
/// (the listener may not be up yet). Throws TimeoutError.
Socket connect_to(const std::string& host, uint16_t port, Clock::time_point deadline);

/// Throw PeerError when the other side closed, TimeoutError at the deadline.
void send_all(int fd, const void* data, size_t n);
void recv_all(int fd, void* data, size_t n, Clock::time_point deadline);

/// The local address the kernel would use to reach `host` (no packet is
/// sent); used to bind Gloo's transport to the interface that reaches peers.
std::string source_address_for(const std::string& host);

bool is_loopback(const std::string& host);

}  // namespace cohort::net
