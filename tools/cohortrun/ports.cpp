#include "ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <system_error>

#include "fd.h"

namespace cohortrun {
namespace {

sockaddr_in loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

UniqueFd tcp_socket() {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    throw std::system_error(errno, std::generic_category(), "socket");
  }
  return fd;
}

}  // namespace

int pick_free_port() {
  UniqueFd fd = tcp_socket();
  sockaddr_in addr = loopback(0);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw std::system_error(errno, std::generic_category(), "bind 127.0.0.1:0");
  }
  socklen_t len = sizeof addr;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::system_error(errno, std::generic_category(), "getsockname");
  }
  return ntohs(addr.sin_port);
}

StoreListener listen_on_free_port() {
  StoreListener l;
  l.fd = tcp_socket();
  // As rank 0's store sets it: the connections it accepts inherit it, and a
  // later init() after finalize() can bind the port again while they linger
  // in TIME_WAIT.
  int one = 1;
  ::setsockopt(l.fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr = loopback(0);
  if (::bind(l.fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw std::system_error(errno, std::generic_category(), "bind 127.0.0.1:0");
  }
  // The ranks may connect before rank 0 serves: their connections wait here.
  if (::listen(l.fd.get(), SOMAXCONN) != 0) {
    throw std::system_error(errno, std::generic_category(), "listen on 127.0.0.1");
  }
  socklen_t len = sizeof addr;
  if (::getsockname(l.fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::system_error(errno, std::generic_category(), "getsockname");
  }
  l.port = ntohs(addr.sin_port);
  return l;
}

bool loopback_port_free(int port) {
  UniqueFd fd = tcp_socket();
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr = loopback(port);
  return ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
}

}  // namespace cohortrun
