#include "cohort/core/store/tcp_store.h"

#include <algorithm>
#include <cstring>

#include "cohort/core/error.h"
#include "cohort/core/store/missing_keys.h"
#include "cohort/core/store/tcp_store_protocol.h"
#include "cohort/core/store/tcp_store_server.h"

namespace cohort {

using namespace tcp_store;

namespace {

// Calls fn on `keys` in slices the server takes in one request
// (kMaxKeysPerRequest), in order, until one returns false.
template <class Fn>
bool in_slices(const std::vector<std::string>& keys, Fn fn) {
  if (keys.size() <= kMaxKeysPerRequest) return fn(keys);
  for (size_t i = 0; i < keys.size(); i += kMaxKeysPerRequest) {
    const size_t end = std::min(keys.size(), i + kMaxKeysPerRequest);
    if (!fn(std::vector<std::string>(keys.begin() + static_cast<long>(i),
                                     keys.begin() + static_cast<long>(end)))) {
      return false;
    }
  }
  return true;
}

Millis left(net::Clock::time_point deadline) {
  return std::max(Millis(0), std::chrono::duration_cast<Millis>(deadline - net::Clock::now()));
}

}  // namespace

TcpStore::TcpStore(std::string host, uint16_t port, bool is_server, Millis timeout,
                   std::string token, net::Socket listener)
    : host_(std::move(host)), port_(port), token_(std::move(token)) {
  timeout_ = timeout;
  if (is_server) {
    TcpStoreServerOptions options;
    options.token = token_;
    server_ = listener.valid() ? std::make_unique<TcpStoreServer>(std::move(listener), options)
                               : std::make_unique<TcpStoreServer>(host_, port_, options);
    port_ = server_->port();
  }
  ensure_connected(net::Clock::now() + timeout_);
}

TcpStore::~TcpStore() = default;

std::string TcpStore::where() const { return "TcpStore at " + host_ + ":" + std::to_string(port_); }

void TcpStore::ensure_connected(net::Clock::time_point deadline) {
  if (conn_.valid()) return;
  // Reconnecting could reach the next group's store on the same port.
  if (closed_) throw PeerError(where() + ": this store was closed by cohort::finalize()");
  try {
    conn_ = net::connect_to(host_, port_, deadline);
  } catch (const TimeoutError& e) {
    throw TimeoutError(where() + ": rendezvous failed, " + e.what() +
                       "; is rank 0 running and MASTER_ADDR/MASTER_PORT the same on every rank?");
  }
  // Speak at once, token or not: the server closes connections that stay
  // silent (they would hold its descriptors), and refuses a wrong token here
  // rather than at the first request.
  auto frame = encode_request(kAuth, {token_});
  try {
    net::send_all(conn_.fd(), frame.data(), frame.size());
    uint32_t len = 0;
    net::recv_all(conn_.fd(), &len, 4, deadline);
    std::vector<uint8_t> body(std::min<uint32_t>(len, 4096));
    net::recv_all(conn_.fd(), body.data(), body.size(), deadline);
    if (body.empty() || body[0] != kOk) {
      throw PeerError("the store refused this connection: " +
                      std::string(body.begin() + (body.empty() ? 0 : 1), body.end()) +
                      " (is COHORT_STORE_TOKEN the same on every rank?)");
    }
  } catch (const TimeoutError& e) {
    conn_.close();
    throw TimeoutError(where() + ": no answer to the connection's first request: " + e.what());
  } catch (const Error& e) {
    conn_.close();
    throw PeerError(where() + ": " + e.what());
  }
}

std::vector<uint8_t> TcpStore::call(uint8_t cmd, const std::vector<std::string>& args,
                                    Millis timeout) {
  const auto deadline = net::Clock::now() + timeout;
  std::unique_lock<std::timed_mutex> lock(mu_, deadline);
  if (!lock.owns_lock()) {
    throw TimeoutError(where() + ": another request on this connection had no reply within " +
                       std::to_string(timeout.count()) + " ms");
  }
  ensure_connected(deadline);
  auto frame = encode_request(cmd, args);
  if (frame.size() - 4 > kMaxFrameBytes) {
    throw InvalidArgument(where() + ": a request of " + std::to_string(frame.size() - 4) +
                          " bytes is over the store's limit of " + std::to_string(kMaxFrameBytes) +
                          " bytes per key and value");
  }
  try {
    net::send_all(conn_.fd(), frame.data(), frame.size());
    uint32_t len = 0;
    net::recv_all(conn_.fd(), &len, 4, deadline);
    std::vector<uint8_t> body(len);
    net::recv_all(conn_.fd(), body.data(), len, deadline);
    if (body.empty() || body[0] == kBadRequest) {
      throw Error(where() + ": server rejected the request: " +
                  std::string(body.begin() + (body.empty() ? 0 : 1), body.end()));
    }
    return body;
  } catch (const TimeoutError&) {
    // The reply may still come; a fresh connection keeps later replies in step.
    conn_.close();
    throw;
  } catch (const PeerError& e) {
    conn_.close();
    throw PeerError(where() + ": " + e.what() +
                    " (rank 0, which hosts the store, may have exited)");
  }
}

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  set_within(key, value, timeout_);
}

std::vector<uint8_t> TcpStore::get(const std::string& key) {
  wait({key}, timeout_);
  auto body = call(kGet, {key}, timeout_);
  if (body[0] == kNotFound) throw Error(where() + ": key '" + key + "' vanished");
  return std::vector<uint8_t>(body.begin() + 1, body.end());
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  auto body = call(kAdd, {key, std::to_string(delta)}, timeout_);
  return std::stoll(std::string(body.begin() + 1, body.end()));
}

bool TcpStore::check(const std::vector<std::string>& keys) { return check_within(keys, timeout_); }

void TcpStore::set_within(const std::string& key, const std::vector<uint8_t>& value,
                          Millis timeout) {
  call(kSet, {key, std::string(value.begin(), value.end())}, timeout);
}

bool TcpStore::check_within(const std::vector<std::string>& keys, Millis timeout) {
  const auto deadline = net::Clock::now() + timeout;
  return in_slices(keys, [&](const std::vector<std::string>& slice) {
    auto body = call(kCheck, slice, left(deadline));
    return body.size() == 2 && body[1] == '1';
  });
}

std::string TcpStore::server() const {
  return server_name_.empty() ? "the process serving " + host_ + ":" + std::to_string(port_)
                              : server_name_;
}

void TcpStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  const auto deadline = net::Clock::now() + timeout;
  try {
    in_slices(keys, [&](const std::vector<std::string>& slice) {
      call(kWait, slice, left(deadline));
      return true;
    });
  } catch (const TimeoutError&) {
    std::vector<std::string> missing;
    for (auto& k : keys) {
      if (!check({k})) missing.push_back(k);
    }
    throw TimeoutError(missing_keys_message(where(), missing, timeout));
  }
}

bool TcpStore::close_for_group(Millis timeout) {
  std::lock_guard<std::timed_mutex> lock(mu_);
  closed_ = true;
  if (server_) {
    server_.reset();
    conn_.close();
    return true;
  }
  // Not connected (a failed request closed it): nothing tells when the
  // server stops, and a new connection might reach a later group's store.
  if (!conn_.valid()) return true;
  // The server never speaks unasked: the next event on the connection is
  // its close.
  try {
    uint8_t byte = 0;
    net::recv_all(conn_.fd(), &byte, 1, net::Clock::now() + timeout);
  } catch (const TimeoutError&) {
    return false;
  } catch (const PeerError&) {
  }
  conn_.close();
  return true;
}

bool TcpStore::delete_key(const std::string& key) {
  auto body = call(kDelete, {key}, timeout_);
  return body.size() == 2 && body[1] == '1';
}

}  // namespace cohort
