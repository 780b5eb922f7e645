// defines: TcpStoreServer, the key-value server rank 0 runs for TcpStore.
//
// One thread, one poll() loop over the listener and the clients. A WAIT whose
// keys are missing is parked and answered when a SET/ADD completes it, so
// waiting ranks cost no traffic.
#pragma once

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "cohort/core/store/socket.h"

namespace cohort {

class TcpStoreServer {
 public:
  TcpStoreServer(const std::string& host, uint16_t port);
  ~TcpStoreServer();
  uint16_t port() const { return port_; }

 private:
  struct Client {
    net::Socket sock;
    std::vector<uint8_t> inbox;
  };
  struct Waiter {
    int fd;
    std::vector<std::string> keys;
  };

  void run();
  void accept_client();
  // False when the client must be dropped.
  bool read_client(Client& c);
  void handle(Client& c, uint8_t cmd, const std::vector<std::string>& args);
  void reply(int fd, uint8_t status, const std::string& body = {});
  void wake_waiters();
  bool has_all(const std::vector<std::string>& keys) const;

  net::Socket listener_;
  uint16_t port_;
  int stop_pipe_[2] = {-1, -1};
  std::map<int, Client> clients_;
  std::vector<Waiter> waiters_;
  std::map<std::string, std::string> data_;
  std::thread thread_;
};

}  // namespace cohort
