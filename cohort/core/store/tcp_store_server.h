// defines: TcpStoreServer, the key-value server rank 0 runs for TcpStore, and
// TcpStoreServerOptions, its limits.
//
// One thread, one poll() loop over the listener and the clients, on
// non-blocking sockets: nothing a client does (or fails to do) can block the
// loop, so every client keeps being served and shutdown is bounded. Replies go
// to a per-client outbox that is flushed as the client reads. A WAIT whose
// keys are missing is parked (one per client: a client has one request in
// flight) and answered when a SET/ADD completes it, so waiting ranks cost no
// traffic; each key indexes the WAITs that name it, so a SET costs the
// clients waiting on its key, not every key waited on.
#pragma once

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cohort/core/store/socket.h"
#include "cohort/core/store/tcp_store_protocol.h"

namespace cohort {

/// Limits that keep one store server's memory and descriptors bounded whatever
/// its clients send. A client that breaks a limit is disconnected; a request
/// that breaks a limit on the data is answered with an error. When the
/// clients together reach max_buffered_bytes, the client holding the most
/// gives way (it is closed) to one that holds less.
struct TcpStoreServerOptions {
  /// Largest request frame accepted (a larger length header drops the client).
  size_t max_frame_bytes = tcp_store::kMaxFrameBytes;
  /// Replies queued for one client that has not read them; over this the
  /// client is dropped (it is not reading, so it cannot be waiting on them).
  size_t max_outbox_bytes = 2 * tcp_store::kMaxFrameBytes;
  /// Unprocessed input, unsent replies and parked WAITs' keys of all clients
  /// together; a WAIT whose keys alone pass it is answered with an error.
  size_t max_buffered_bytes = 256u << 20;
  /// Keys and values stored; a SET or ADD beyond it is answered with an error.
  size_t max_stored_bytes = 256u << 20;
  /// Connected clients, and at most half the process's descriptor limit (the
  /// rank needs the rest for its own connections). At the cap, or when
  /// accept() finds no descriptor, the oldest silent client (one that has
  /// sent no complete frame) is closed to admit the new one; with no silent
  /// client, the new connection is closed at once.
  size_t max_clients = 4096;
  /// A client that has sent no complete frame this long after it was
  /// accepted is closed. TcpStore sends one as soon as it connects.
  std::chrono::milliseconds handshake_timeout{5000};
  /// A client that has sent part of a request, or left part of a reply
  /// unread, and made no progress on it this long is closed.
  std::chrono::milliseconds stall_timeout{10000};
  /// When not empty, every client must send it (kAuth) before any other
  /// request; a client that does not is disconnected.
  std::string token;
};

/// The server behind TcpStore: serves SET/GET/ADD/CHECK/WAIT/DELETE until
/// destroyed. Never throws or dies from what a client sends.
class TcpStoreServer {
 public:
  /// Listens on host:port (port 0 picks a free port) and starts serving.
  TcpStoreServer(const std::string& host, uint16_t port, TcpStoreServerOptions options = {});
  /// Serves on `listener`, a socket already listening (see net::adopt_listener).
  TcpStoreServer(net::Socket listener, TcpStoreServerOptions options = {});
  /// Stops the loop and joins it; bounded because the loop never blocks
  /// outside poll().
  ~TcpStoreServer();
  /// The port listened on.
  uint16_t port() const { return port_; }

 private:
  struct Client {
    net::Socket sock;
    std::vector<uint8_t> inbox;
    std::vector<uint8_t> outbox;
    size_t sent = 0;  // bytes of outbox already sent
    std::chrono::steady_clock::time_point accepted_at;
    std::chrono::steady_clock::time_point progress_at;  // last byte read or sent
    size_t parked_bytes = 0;  // its parked WAIT's share of buffered_bytes_
    bool dropped = false;
    bool authenticated = false;
    bool spoke = false;   // has sent a complete, valid frame
    bool parked = false;  // a WAIT of its is waiting for keys
    size_t held() const { return inbox.size() + outbox.size() + parked_bytes; }
  };
  // A parked WAIT: its distinct keys, and how many of them are missing.
  struct Waiter {
    std::vector<std::string> keys;
    size_t missing = 0;
  };

  void run();
  void accept_clients();
  // Closes the longest-connected silent client at once (its descriptor is
  // free on return); false when every client has spoken.
  bool evict_oldest_silent();
  // Drops silent clients past the handshake deadline and stalled ones past
  // the stall timeout; returns the time until the next one expires (or -1
  // when none is waiting), for poll().
  int expire_silent(std::chrono::steady_clock::time_point now);
  // Makes room for `bytes` more for `c` in the shared buffer by closing the
  // clients that hold more than `c` would; false when `c` holds the most.
  bool make_room(const Client& c, size_t bytes);
  // Reads what the client sent and handles every complete frame.
  void read_client(Client& c);
  void flush(Client& c);
  void drop(Client& c);
  void handle(Client& c, uint8_t cmd, const std::vector<std::string>& args);
  void authenticate(Client& c, uint8_t cmd, const std::vector<std::string>& args);
  void handle_add(Client& c, const std::vector<std::string>& args);
  void store_value(Client& c, const std::string& key, std::string value, bool echo);
  void reply(Client& c, uint8_t status, const std::string& body = {});
  void park(Client& c, const std::vector<std::string>& args);
  void unpark(Client& c);
  // A key came (answering the WAITs it completes) or went.
  void key_changed(const std::string& key, bool added);
  bool has_all(const std::vector<std::string>& keys) const;

  TcpStoreServerOptions opt_;
  size_t client_cap_;  // max_clients, and half the descriptor limit
  net::Socket listener_;
  uint16_t port_;
  int stop_pipe_[2] = {-1, -1};
  std::map<int, Client> clients_;
  std::map<int, Waiter> waiters_;                  // by client descriptor
  std::map<std::string, std::set<int>> watchers_;  // key -> the waiters naming it
  std::map<std::string, std::string> data_;
  size_t stored_bytes_ = 0;
  size_t buffered_bytes_ = 0;
  // Out of descriptors, accept() fails at once: stop polling the listener
  // until this time instead of spinning.
  std::chrono::steady_clock::time_point accept_paused_until_{};
  std::thread thread_;
};

}  // namespace cohort
