// The Worker's life: which transports UCX may use (locality), the address
// exchange through the group's store, and an orderly close.
#include <dirent.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <thread>

#include "cohort/comm/ucx/worker.h"
#include "cohort/core/error.h"
#include "cohort/core/process_identity.h"
#include "cohort/core/store/socket.h"

namespace cohort::ucx {
namespace {

std::string read_line(const char* path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

// Ranks with the same identity share memory: the same kernel (boot id) and,
// since a separate network namespace stands for another host in cohort's
// launcher tests, the same network namespace. Read per group, from the
// ranks themselves, not from a launcher's environment.
std::string host_identity() {
  char name[256] = {0};
  ::gethostname(name, sizeof(name) - 1);
  char ns[128] = {0};
  const ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
  return std::string(name) + "|" + read_line("/proc/sys/kernel/random/boot_id") + "|" +
         (n > 0 ? std::string(ns, static_cast<size_t>(n)) : "");
}

// The interface that carries `address` (numeric IPv4/IPv6), or "".
std::string interface_of(const std::string& address) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (auto* a = list; a && found.empty(); a = a->ifa_next) {
    if (!a->ifa_addr) continue;
    const int family = a->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    char host[NI_MAXHOST];
    const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (::getnameinfo(a->ifa_addr, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) == 0 &&
        address == host) {
      found = a->ifa_name;
    }
  }
  ::freeifaddrs(list);
  return found;
}

// UCX does not say when it ran out of file descriptors: its shared-memory
// transports then fail as "Endpoint timeout" or "Shared memory error". Each
// group's context and worker take several (about 6 at world 2), so when the
// process is within a group's worth of its limit, that is named instead.
std::string descriptor_note() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return "";
  const auto limit = static_cast<long long>(r.rlim_cur);
  long long open = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d)) ++open;
    ::closedir(d);
    open -= 3;  // ".", ".." and the directory's own descriptor
  } else if (errno == EMFILE) {
    open = limit;  // not even one left to read the count with
  }
  constexpr int kGroupWorth = 32;
  if (open + kGroupWorth < limit) return "";
  return " (this process has " + std::to_string(open) + " file descriptors open of its limit of " +
         std::to_string(limit) +
         " (ulimit -n): every UCX group takes several; raise the limit, e.g. ulimit -n 65536, "
         "or build fewer groups)";
}

void check(ucs_status_t s, const std::string& what) {
  if (s != UCS_OK) {
    throw ConfigError("ucx: " + what + ": " + ucs_status_string(s) + descriptor_note());
  }
}

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

// The address exchange through the group's store, in stages ("host",
// "address", "connected"): each rank publishes its value under
// cohort/ucx/STAGE/RANK and reads everyone's. A value starts with a status
// byte. A rank that cannot join (out of descriptors, a bad UCX_TLS)
// publishes its error under every stage it has not reached, so the others
// fail at once, naming it, instead of waiting out the timeout.
class Worker::Exchange {
 public:
  Exchange(Store& store, int rank, int size, Millis timeout)
      : store_(store), rank_(rank), size_(size), timeout_(timeout) {}

  std::vector<std::vector<uint8_t>> operator()(const std::string& stage,
                                               std::vector<uint8_t> mine) {
    mine.insert(mine.begin(), kJoined);
    store_.set(key(stage, rank_), mine);
    ++published_;
    std::vector<std::string> keys;
    for (int r = 0; r < size_; ++r) keys.push_back(key(stage, r));
    store_.wait(keys, timeout_);
    std::vector<std::vector<uint8_t>> all;
    for (int r = 0; r < size_; ++r) {
      auto v = store_.get(keys[static_cast<size_t>(r)]);
      if (v.empty() || v[0] != kJoined) {
        const std::string why = "ucx: rank " + std::to_string(r) + " could not join the group: " +
                                std::string(v.begin() + (v.empty() ? 0 : 1), v.end());
        if (!v.empty() && v[0] == kConfigFailure) throw ConfigError(why);
        throw PeerError(why);
      }
      all.emplace_back(v.begin() + 1, v.end());
    }
    return all;
  }

  // Publishes `e` under the stages this rank has not published. Never
  // throws: the store may be what failed.
  void fail(const std::exception& e) noexcept {
    try {
      std::vector<uint8_t> v{dynamic_cast<const ConfigError*>(&e) ? kConfigFailure : kFailure};
      const std::string what = e.what();
      v.insert(v.end(), what.begin(), what.end());
      for (size_t i = static_cast<size_t>(published_); i < std::size(kStages); ++i) {
        store_.set(key(kStages[i], rank_), v);
      }
    } catch (...) {
    }
  }

 private:
  static constexpr uint8_t kJoined = 0, kConfigFailure = 1, kFailure = 2;
  static constexpr const char* kStages[] = {"host", "address", "connected"};
  static std::string key(const std::string& stage, int rank) {
    return "cohort/ucx/" + stage + "/" + std::to_string(rank);
  }

  Store& store_;
  int rank_, size_;
  Millis timeout_;
  int published_ = 0;
};

Worker::Worker(Store& store, int rank, int size, const WorkerConfig& config, Millis timeout)
    : rank_(rank),
      size_(size),
      peer_slots_(new PeerSlot[static_cast<size_t>(size)]),
      control_(*this, rank, size),
      check_(*this, rank, size) {
  Exchange exchange(store, rank, size, timeout);
  try {
    rendezvous(exchange, config);
  } catch (const std::exception& e) {
    exchange.fail(e);
    close();
    throw;
  }
}

Worker::~Worker() { close(); }

void Worker::rendezvous(Exchange& exchange, const WorkerConfig& config) {
  // Each rank's host, then its process: the hosts decide the transports;
  // the processes let a timeout tell a peer on this machine that exited or
  // was killed from one that is stopped (process_identity.h).
  const auto host = host_identity();
  single_host_ = true;
  for (auto& v : exchange("host", to_bytes(host + "\n" + this_process()))) {
    const std::string s(v.begin(), v.end());
    const auto cut = s.find('\n');
    single_host_ &= s.substr(0, cut) == host;
    processes_.push_back(cut == std::string::npos ? "" : s.substr(cut + 1));
  }

  ucp_config_t* cfg = nullptr;
  check(ucp_config_read(nullptr, nullptr, &cfg), "reading UCX's configuration");
  // The user's UCX_TLS / UCX_NET_DEVICES win. Otherwise: on one host,
  // shared memory only (posix, sysv, CMA: nothing listens on a socket);
  // across hosts, UCX's transports on the interface the other ranks reach.
  transports_ = "UCX's default";
  ucs_status_t s = UCS_OK;
  if (!std::getenv("UCX_TLS") && single_host_) {
    transports_ = "self,sm";
    s = ucp_config_modify(cfg, "TLS", "self,sm");
  } else if (!std::getenv("UCX_NET_DEVICES")) {
    std::string dev = config.interface;
    if (dev.empty() && !net::is_loopback(config.bind_address)) {
      dev = interface_of(config.bind_address);
    }
    if (!dev.empty()) {
      transports_ += " on " + dev;
      s = ucp_config_modify(cfg, "NET_DEVICES", dev.c_str());
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.estimated_num_eps = static_cast<size_t>(size_);
  if (s == UCS_OK) s = ucp_init(&params, cfg, &context_);
  ucp_config_release(cfg);
  check(s, "creating the context (transports " + transports_ + ")");

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  check(ucp_worker_create(context_, &wp, &worker_), "creating the worker");
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  check(ucp_worker_query(worker_, &attr), "querying the worker");
  // The engine's thread and the callers' threads progress one worker.
  if (attr.thread_mode != UCS_THREAD_MODE_MULTI) {
    throw ConfigError("ucx: this libucx has no thread support (built without --enable-mt)");
  }
  int event_fd = -1;
  check(ucp_worker_get_efd(worker_, &event_fd), "getting the worker's event fd");
  progress_.attach(worker_, event_fd);

  ucp_address_t* address = nullptr;
  size_t length = 0;
  check(ucp_worker_get_address(worker_, &address, &length), "getting the worker's address");
  const auto* a = reinterpret_cast<const uint8_t*>(address);
  std::vector<uint8_t> mine(a, a + length);
  ucp_worker_release_address(worker_, address);
  create_endpoints(exchange("address", std::move(mine)));
  // Nobody leaves the rendezvous before everyone has connected: a rank that
  // finished its work early and closed its worker would take the shared
  // memory a slower peer was about to attach to ("Shared memory error").
  exchange("connected", {1});
  control_.post_receive();
}

void Worker::create_endpoints(const std::vector<std::vector<uint8_t>>& addresses) {
  for (int r = 0; r < size_; ++r) {
    auto& slot = peer_slots_[static_cast<size_t>(r)];
    slot.self = this;
    slot.rank = r;
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = reinterpret_cast<const ucp_address_t*>(addresses[static_cast<size_t>(r)].data());
    // Across hosts a dead peer is an error on its endpoint. UCX 1.13's
    // shared-memory transports have no peer-failure handling and refuse
    // endpoints that ask for it, so on one host a dead peer is a timeout.
    p.err_mode = single_host_ ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = on_peer_error;
    p.err_handler.arg = &slot;
    ucp_ep_h ep = nullptr;
    check(ucp_ep_create(worker_, &p, &ep), "connecting to rank " + std::to_string(r));
    endpoints_.push_back(ep);
  }
}

void Worker::on_peer_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* slot = static_cast<PeerSlot*>(arg);
  slot->status.store(status);
  slot->self->peer_failed_.store(true, std::memory_order_release);
}

// Bounded at every step: a dead peer must not hang the close.
void Worker::close() {
  if (!worker_) {
    if (context_) ucp_cleanup(context_);
    return;
  }
  auto drive = [&](void* request, Millis most) {
    if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
    const auto until = Clock::now() + most;
    while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < until) {
      if (!progress_.poll()) std::this_thread::yield();
    }
    ucp_request_free(request);
  };
  // A peer still waiting in a collective this rank never ran learns now
  // that it never will (a rank that called more collectives than the rest).
  if (static_cast<int>(endpoints_.size()) == size_ && control_.open()) {
    // Clean: every collective it began ended and nothing failed, so its
    // peers may take its endpoint's coming error for the close it is.
    control_.notify_closed(check_.begun(), !check_.inside() && !failure_.failed());
  }
  // Sends the callers did not wait for (the last notices) reach their peers.
  ucp_request_param_t p{};
  drive(ucp_worker_flush_nbx(worker_, &p), Millis(2000));
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& t : inflight_) {
      if (!t->done.load(std::memory_order_acquire)) ucp_request_cancel(worker_, t->request);
    }
  }
  for (auto* ep : endpoints_) {
    ucp_request_param_t cp{};
    cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    drive(ucp_ep_close_nbx(ep, &cp), Millis(1000));
  }
  // A cancelled request (or one purged by its endpoint's forced close)
  // completes only as the worker progresses, and holds its buffer's memory
  // registration until then; UCX (1.18) aborts the process in ucp_cleanup
  // over a registration still held. So progress until none is left, and if
  // one never completes, leave the worker and context to the process's end
  // rather than let UCX abort it.
  bool settled = false;
  for (const auto until = Clock::now() + Millis(2000);;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      prune_locked();
      settled = inflight_.empty();
    }
    if (settled || Clock::now() >= until) break;
    if (!progress_.poll()) std::this_thread::yield();
  }
  if (!settled) {
    worker_ = nullptr;
    context_ = nullptr;
    return;
  }
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
  worker_ = nullptr;
  context_ = nullptr;
}

}  // namespace cohort::ucx
