// defines: TcpStore, the Store behind torchrun-style rendezvous
// (MASTER_ADDR:MASTER_PORT). Rank 0 hosts the server; every rank, rank 0
// included, is a client.
//
// Why not c10d's TCPStore: in LibTorch 1.13 its server binds every interface,
// and cohort listens on loopback alone unless the user gives another address.
#pragma once

#include <memory>
#include <mutex>

#include "cohort/core/store/socket.h"
#include "cohort/core/store/store.h"

namespace cohort {

class TcpStoreServer;

/// A Store served over TCP by one process (is_server) and reached by every rank, like c10d's
/// TCPStore. Operations throw TimeoutError when no reply comes in time, PeerError when the
/// connection fails. check() and wait() on more keys than the server takes in one request
/// (65536) send them in slices, one after another, within the one timeout.
class TcpStore : public Store {
 public:
  /// is_server: host the store on host:port (port 0 picks a free port; see
  /// port()), or on `listener` when it is valid (a socket already listening
  /// on that port: net::adopt_listener). Clients retry connecting until
  /// `timeout`. A non-empty `token` is shown on every connection, and the
  /// server (is_server) requires it of every client.
  TcpStore(std::string host, uint16_t port, bool is_server, Millis timeout, std::string token = {},
           net::Socket listener = {});
  ~TcpStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  bool delete_key(const std::string& key) override;
  /// set() that waits at most `timeout` for the reply, then throws
  /// TimeoutError: for a caller that must learn soon whether the process
  /// serving the store still answers.
  void set_within(const std::string& key, const std::vector<uint8_t>& value, Millis timeout);
  /// check() that waits at most `timeout` for the reply, as set_within().
  bool check_within(const std::vector<std::string>& keys, Millis timeout);
  /// How errors name the process serving this store: the name
  /// set_server_name() gave, else "the process serving HOST:PORT".
  std::string server() const;
  /// How errors name the process serving this store ("world rank 0"): its
  /// creator knows which rank that is. Set before the store is shared.
  void set_server_name(std::string name) { server_name_ = std::move(name); }

  /// The port the server listens on (the one picked when constructed with port 0).
  uint16_t port() const { return port_; }

  /// Ends this store for its group (cohort::finalize()): the server's host
  /// stops serving at once (its listener closes before its clients'
  /// connections); a client waits up to `timeout` until the server closes
  /// its connection, so that a rank that then builds a new group on the same
  /// port cannot reach this one. Returns false when the server still serves
  /// at the timeout. Later calls on this store throw PeerError.
  bool close_for_group(Millis timeout);

 private:
  /// One request and its reply on the client connection.
  std::vector<uint8_t> call(uint8_t cmd, const std::vector<std::string>& args, Millis timeout);
  void ensure_connected(net::Clock::time_point deadline);
  std::string where() const;

  std::string host_;
  uint16_t port_;
  std::string token_;
  std::string server_name_;
  std::unique_ptr<TcpStoreServer> server_;
  // One request at a time on the connection; timed, so that a request with
  // a deadline does not wait past it behind another one.
  std::timed_mutex mu_;
  net::Socket conn_;
  bool closed_ = false;  // close_for_group() ran (under mu_)
};

}  // namespace cohort
