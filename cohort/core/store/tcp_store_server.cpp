#include "cohort/core/store/tcp_store_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "cohort/core/error.h"
#include "cohort/core/store/tcp_store_protocol.h"

namespace cohort {

using namespace tcp_store;

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port)
    : listener_(net::listen_on(host, port)), port_(net::local_port(listener_)) {
  if (::pipe2(stop_pipe_, O_CLOEXEC) != 0) {
    throw Error(std::string("TcpStoreServer: pipe failed: ") + std::strerror(errno));
  }
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::~TcpStoreServer() {
  char b = 0;
  (void)!::write(stop_pipe_[1], &b, 1);
  thread_.join();
  ::close(stop_pipe_[0]);
  ::close(stop_pipe_[1]);
}

void TcpStoreServer::run() {
  std::vector<pollfd> fds;
  while (true) {
    fds.clear();
    fds.push_back({stop_pipe_[0], POLLIN, 0});
    fds.push_back({listener_.fd(), POLLIN, 0});
    for (auto& [fd, c] : clients_) fds.push_back({fd, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents) return;
    if (fds[1].revents & POLLIN) accept_client();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      auto it = clients_.find(fds[i].fd);
      if (it == clients_.end()) continue;
      if (!read_client(it->second)) {
        int fd = it->first;
        waiters_.erase(std::remove_if(waiters_.begin(), waiters_.end(),
                                      [fd](const Waiter& w) { return w.fd == fd; }),
                       waiters_.end());
        clients_.erase(it);
      }
    }
  }
}

void TcpStoreServer::accept_client() {
  int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return;
  clients_[fd].sock = net::Socket(fd);
}

bool TcpStoreServer::read_client(Client& c) {
  uint8_t buf[65536];
  ssize_t k = ::recv(c.sock.fd(), buf, sizeof(buf), 0);
  if (k <= 0) return k < 0 && errno == EINTR;
  c.inbox.insert(c.inbox.end(), buf, buf + k);
  // Handle every complete frame in the inbox.
  size_t pos = 0;
  while (c.inbox.size() - pos >= 4) {
    uint32_t len;
    std::memcpy(&len, c.inbox.data() + pos, 4);
    if (c.inbox.size() - pos - 4 < len) break;
    uint8_t cmd = 0;
    std::vector<std::string> args;
    if (!decode_request(c.inbox.data() + pos + 4, len, cmd, args)) return false;
    handle(c, cmd, args);
    pos += 4 + len;
  }
  c.inbox.erase(c.inbox.begin(), c.inbox.begin() + static_cast<long>(pos));
  return true;
}

bool TcpStoreServer::has_all(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(),
                     [&](const std::string& k) { return data_.count(k) > 0; });
}

void TcpStoreServer::handle(Client& c, uint8_t cmd, const std::vector<std::string>& args) {
  const int fd = c.sock.fd();
  switch (cmd) {
    case kSet:
      if (args.size() != 2) break;
      data_[args[0]] = args[1];
      reply(fd, kOk);
      wake_waiters();
      return;
    case kGet: {
      if (args.size() != 1) break;
      auto it = data_.find(args[0]);
      if (it == data_.end()) {
        reply(fd, kNotFound);
      } else {
        reply(fd, kOk, it->second);
      }
      return;
    }
    case kAdd: {
      if (args.size() != 2) break;
      auto& v = data_[args[0]];
      int64_t value = (v.empty() ? 0 : std::stoll(v)) + std::stoll(args[1]);
      v = std::to_string(value);
      reply(fd, kOk, v);
      wake_waiters();
      return;
    }
    case kCheck:
      reply(fd, kOk, has_all(args) ? "1" : "0");
      return;
    case kWait:
      if (has_all(args)) {
        reply(fd, kOk);
      } else {
        waiters_.push_back({fd, args});
      }
      return;
    case kDelete:
      if (args.size() != 1) break;
      reply(fd, kOk, data_.erase(args[0]) ? "1" : "0");
      return;
    default:
      break;
  }
  reply(fd, kBadRequest);
}

void TcpStoreServer::reply(int fd, uint8_t status, const std::string& body) {
  std::vector<uint8_t> frame;
  put_u32(frame, static_cast<uint32_t>(1 + body.size()));
  frame.push_back(status);
  frame.insert(frame.end(), body.begin(), body.end());
  try {
    net::send_all(fd, frame.data(), frame.size());
  } catch (const Error&) {
    // The client went away; poll() reports the hang-up and drops it.
  }
}

void TcpStoreServer::wake_waiters() {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (has_all(it->keys)) {
      reply(it->fd, kOk);
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace cohort
