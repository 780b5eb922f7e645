#include "cohort/comm/init.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <utility>

#include "cohort/algorithms/hierarchical.h"
#include "cohort/comm/engine_registry.h"
#include "cohort/comm/gloo/c10d_adapter.h"
#include "cohort/core/blas_workspace.h"
#include "cohort/core/env.h"
#include "cohort/core/error.h"
#include "cohort/core/slurm.h"
#include "cohort/core/store/socket.h"
#include "cohort/core/store/tcp_store.h"

namespace cohort {
namespace {

std::mutex g_world_mu;
std::shared_ptr<Communicator> g_world;

struct Endpoint {
  std::string host;
  int port = 0;
};

// "tcp://HOST:PORT" -> {HOST, PORT}; IPv6 hosts in brackets.
Endpoint parse_tcp(const std::string& url) {
  const std::string rest = url.substr(6);
  const auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    throw ConfigError("cohort::init: init_method '" + url + "' is not tcp://HOST:PORT");
  }
  Endpoint e;
  e.host = rest.substr(0, colon);
  if (e.host.front() == '[' && e.host.back() == ']') e.host = e.host.substr(1, e.host.size() - 2);
  try {
    size_t used = 0;
    e.port = std::stoi(rest.substr(colon + 1), &used);
    if (used != rest.size() - colon - 1) e.port = -1;
  } catch (const std::exception&) {
    e.port = -1;
  }
  if (e.port < 0 || e.port > 65535) {
    throw ConfigError("cohort::init: port in '" + url + "' is not in [0, 65535]");
  }
  return e;
}

bool spans_hosts(int world_size, const std::optional<slurm::Step>& step) {
  if (step) return step->hosts.size() > 1;
  auto local = env::get_int("LOCAL_WORLD_SIZE", 1, 1 << 20);
  return local && *local < world_size;
}

// The Slurm job step this process is a task of, unless a launcher nearer
// to it says otherwise: torchrun's variables (cohortrun's ranks inherit the
// step's SLURM_ ones), or Open MPI's (under mpirun inside an allocation the
// SLURM_ ones describe the batch step, not the MPI ranks).
std::optional<slurm::Step> slurm_step() {
  if (env::get("RANK") || env::get("WORLD_SIZE") || env::get("OMPI_COMM_WORLD_SIZE")) {
    return std::nullopt;
  }
  return slurm::job_step();
}

int world_size_from_environment() {
  // A batch script (or salloc shell) is one process whatever SLURM_NTASKS
  // says; as rank 0 of that many it would wait for ranks never started.
  if (!env::get("WORLD_SIZE") && !env::get("RANK") && !env::get("OMPI_COMM_WORLD_SIZE") &&
      env::get("SLURM_JOB_ID")) {
    throw ConfigError(
        "cohort::init: WORLD_SIZE is not set and this process is in a Slurm job but not in a "
        "job step (SLURM_STEP_ID is unset or one of Slurm's own: a batch script or an salloc "
        "shell, one process); "
        "start the ranks with `srun PROGRAM` (a task per rank) or `srun cohortrun -n N -- "
        "PROGRAM` (a launcher per node)");
  }
  return env::require_int("WORLD_SIZE", 1, 1 << 20);
}

// The environment's part of the options (the only place cohort reads it for
// a communicator); explicit InitOptions win. Bad values are ConfigErrors
// naming the variable.
ConnectOptions options_from_environment(const InitOptions& options) {
  ConnectOptions co;
  co.backend = !options.backend.empty() ? options.backend
                                        : env::get("COHORT_BACKEND").value_or(default_backend());
  std::string auto_reason;
  if (co.backend == "auto") co.backend = resolve_auto_backend(&auto_reason);
  require_backend(co.backend, "cohort::init");
  co.timeout = options.timeout ? *options.timeout
                               : env::timeout("COHORT_TIMEOUT").value_or(std::chrono::minutes(30));
  if (options.debug_checks) {
    co.debug_checks = *options.debug_checks;
  } else if (auto d = env::get("COHORT_DEBUG")) {
    if (*d != "detail" && *d != "off") {
      throw ConfigError("cohort::init: COHORT_DEBUG='" + *d + "' is not 'detail' or 'off'");
    }
    co.debug_checks = *d == "detail";
  }
  if (options.algorithm) {
    co.algorithm = *options.algorithm;
  } else if (auto name = env::get("COHORT_ALGO")) {
    auto a = parse_algorithm(*name);
    if (!a || *a == Algorithm::Default) {
      throw ConfigError("cohort::init: COHORT_ALGO='" + *name +
                        "' is not one of engine, ring, tree, hd, hierarchical, adaptive");
    }
    co.algorithm = *a;
  }
  if (co.debug_checks && !auto_reason.empty()) {
    std::fprintf(stderr, "cohort: rank %s: backend auto is %s: %s\n",
                 env::get("RANK").value_or("?").c_str(), co.backend.c_str(), auto_reason.c_str());
  }
  co.calibration_max_bytes =
      env::get_int("COHORT_CALIBRATION_MAX_BYTES", 1024, 1 << 30).value_or(0);
  // The hierarchical algorithm's node key: an explicit id, else the host and
  // cohortrun's node index (two launchers on one host are two nodes).
  if (auto id = env::get("COHORT_NODE_ID")) {
    co.node = "id:" + *id;
  } else if (auto group = env::get("GROUP_RANK")) {
    co.node = algorithms::host_name() + "/group:" + *group;
  }
  co.gloo.interface = env::get("GLOO_SOCKET_IFNAME").value_or("");
  co.trace_dir = options.trace_dir ? *options.trace_dir : env::get("COHORT_TRACE").value_or("");
  co.trace_max_events = env::get_int("COHORT_TRACE_MAX_EVENTS", 1, 1 << 30).value_or(0);
  return co;
}

// Ranks started without an MPI launcher (cohortrun without --backend mpi)
// are each an MPI world of one: they would run as independent jobs.
void refuse_mpi_singletons(int mpi_size, const InitOptions& options) {
  if (mpi_size != 1) return;
  const int claimed = options.world_size > 0 ? options.world_size
                                             : env::get_int("WORLD_SIZE", 1, 1 << 20).value_or(1);
  if (claimed <= 1) return;
  const std::string n = std::to_string(claimed);
  throw ConfigError("cohort::init (backend mpi): WORLD_SIZE=" + n +
                    " (RANK=" + env::get("RANK").value_or("?") +
                    ") but MPI started this process as a world of 1: the ranks were not "
                    "started by an MPI launcher. Start an MPI job with `cohortrun --backend "
                    "mpi -n " +
                    n + " -- PROGRAM` or `mpirun -n " + n + " PROGRAM`");
}

// Where the job's store listens: a Slurm step's, torchrun's variables
// (env:// or no method), or a tcp:// URL.
Endpoint rendezvous_endpoint(const std::string& method, const std::optional<slurm::Step>& step) {
  Endpoint ep;
  if ((method == "env://" || method.empty()) && step) {
    // Refused at once, on every task alike, where this task cannot tell
    // whether it serves: a store nobody serves would be waited for.
    if (!step->master_unknown.empty()) throw ConfigError(step->master_unknown);
    ep.host = step->master_addr;
    ep.port = step->master_port;
  } else if (method == "env://" || method.empty()) {
    ep.host = env::get("MASTER_ADDR").value_or("");
    if (ep.host.empty()) {
      throw ConfigError(
          "environment variable MASTER_ADDR is not set; start the job with "
          "cohortrun (or torchrun), or use init_method file:// or tcp://");
    }
    ep.port = env::require_int("MASTER_PORT", 1, 65535);
  } else if (method.rfind("tcp://", 0) == 0) {
    ep = parse_tcp(method);
  } else {
    throw ConfigError("init_method '" + method + "' is not env://, tcp:// or file://");
  }
  return ep;
}

// The socket cohortrun bound for rank 0's store and handed down
// (COHORT_STORE_FD), when it listens on the rendezvous port: serving on it
// leaves no moment in which another process can take the port. Looked at
// once per process (under g_world_mu), so that a later init() after
// finalize() binds the port itself; a descriptor that is not such a socket
// stays untouched. (Not unsetenv: other threads may read the environment.)
net::Socket inherited_store_listener(bool serve, int port) {
  static bool looked = false;
  if (std::exchange(looked, true)) return {};
  const auto fd = env::get("COHORT_STORE_FD");
  if (!fd) return {};
  char* end = nullptr;
  const long n = std::strtol(fd->c_str(), &end, 10);
  if (!serve || fd->empty() || *end != '\0' || n < 0 || n > INT32_MAX) return {};
  return net::adopt_listener(static_cast<int>(n), static_cast<uint16_t>(port));
}

// The job's TCP store, rank 0 serving it (a Slurm step's: the task
// slurm::Step::serves_store names); this rank's claim on its RANK.
std::shared_ptr<Store> open_tcp_store(const Endpoint& ep, int rank,
                                      const std::optional<slurm::Step>& step, Millis timeout) {
  const bool serve = step ? step->serves_store : rank == 0;
  // cohortrun sets a per-job token; other launchers (or a user, for
  // several nodes) may set one, and without one the store is open.
  auto tcp = std::make_shared<TcpStore>(ep.host, static_cast<uint16_t>(ep.port), serve, timeout,
                                        env::get("COHORT_STORE_TOKEN").value_or(""),
                                        inherited_store_listener(serve, ep.port));
  tcp->set_server_name(step && !env::get("MASTER_ADDR") && step->hosts.size() > 1
                           ? "the Slurm task with SLURM_LOCALID 0 on " + ep.host
                           : "world rank 0");
  // This store is new to this job: a second claim on a rank is a
  // second process started with the same RANK.
  const std::string claim = "cohort/init/rank-claims/" + std::to_string(rank);
  if (tcp->add(claim, 1) > 1) {
    throw ConfigError("RANK=" + std::to_string(rank) +
                      " is used by more than one process (a duplicate RANK); every "
                      "process needs its own RANK in [0, WORLD_SIZE)");
  }
  return tcp;
}

// Binds Gloo where the peers can reach this rank, and nowhere else.
void choose_bind_address(ConnectOptions& co, const std::string& master_host, int world_size,
                         const std::optional<slurm::Step>& step, const std::string& where) {
  if (auto addr = env::get("COHORT_BIND_ADDR")) {
    co.gloo.bind_address = *addr;
  } else if (!master_host.empty() && !net::is_loopback(master_host)) {
    co.gloo.bind_address = net::source_address_for(master_host);
  } else if (co.gloo.interface.empty() && spans_hosts(world_size, step)) {
    throw ConfigError(where +
                      ": the ranks span several hosts (LOCAL_WORLD_SIZE < WORLD_SIZE, or a Slurm "
                      "step on several nodes) but the rendezvous is local; set COHORT_BIND_ADDR or "
                      "GLOO_SOCKET_IFNAME");
  }
}

}  // namespace

std::shared_ptr<Communicator> connect(std::shared_ptr<Store> store, int rank, int world_size,
                                      const ConnectOptions& options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw InvalidArgument("cohort::connect: rank " + std::to_string(rank) +
                          " is not in a world of " + std::to_string(world_size));
  }
  // Before the job's model and data take the memory: a rank that later runs
  // out must fail, not spin in the BLAS (see blas_workspace.h).
  reserve_blas_workspace();
  store->set_timeout(options.timeout);
  auto engine = create_engine(store, rank, world_size, options);
  return std::make_shared<Communicator>(std::move(engine), std::move(store), options);
}

std::shared_ptr<Communicator> init(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_world_mu);
  if (g_world) throw ConfigError("cohort::init: already initialized; call finalize() first");

  ConnectOptions co = options_from_environment(options);
  // Under mpirun (or after the application's MPI_Init) the ranks and the
  // store come from the engine's launcher instead of the environment.
  const auto launched = launched_world(co.backend, co.timeout);
  if (launched && co.backend == "mpi") refuse_mpi_singletons(launched->size, options);
  // Else torchrun's variables, else a Slurm job step's (slurm_step()).
  const auto step = launched ? std::nullopt : slurm_step();
  const int world_size = options.world_size > 0 ? options.world_size
                         : launched             ? launched->size
                         : step                 ? step->size
                                                : world_size_from_environment();
  const int rank = options.rank >= 0 ? options.rank
                   : launched        ? launched->rank
                   : step            ? step->rank
                                     : env::require_int("RANK", 0, world_size - 1);
  if (rank >= world_size) {
    throw ConfigError("cohort::init: rank " + std::to_string(rank) +
                      " is not below the world size " + std::to_string(world_size));
  }
  const std::string where = "cohort::init (rank " + std::to_string(rank) + " of " +
                            std::to_string(world_size) + ", backend " + co.backend + ")";

  std::shared_ptr<Store> store;
  std::string master_host;
  const auto& method = options.init_method;
  try {
    if (launched) {
      store = launched->store;
    } else if (method.rfind("file://", 0) == 0) {
      store = make_file_store(method.substr(7), world_size, co.timeout);
    } else {
      const Endpoint ep = rendezvous_endpoint(method, step);
      master_host = ep.host;
      store = open_tcp_store(ep, rank, method.empty() || method == "env://" ? step : std::nullopt,
                             co.timeout);
    }
  } catch (const TimeoutError& e) {
    throw TimeoutError(where + ": rendezvous with the store's server failed: " + e.what());
  } catch (const Error& e) {
    throw ConfigError(where + ": " + e.what());
  }

  choose_bind_address(co, master_host, world_size, step, where);

  try {
    g_world = connect(store, rank, world_size, co);
  } catch (const TimeoutError& e) {
    throw TimeoutError(where + ": connecting to the other ranks failed: " + e.what());
  } catch (const InvalidArgument& e) {
    throw ConfigError(where + ": " + e.what());
  }
  return g_world;
}

int local_rank() {
  if (auto r = env::get_int("LOCAL_RANK", 0, 1 << 20)) return *r;
  if (auto r = env::get_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, 1 << 20)) return *r;
  if (auto step = slurm_step()) return step->local_rank;
  return 0;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_world_mu);
  return g_world != nullptr;
}

std::shared_ptr<Communicator> world_ptr() {
  std::lock_guard<std::mutex> lock(g_world_mu);
  if (!g_world) throw ConfigError("cohort::world: call cohort::init() first");
  return g_world;
}

Communicator& world() { return *world_ptr(); }

void finalize() {
  std::lock_guard<std::mutex> lock(g_world_mu);
  if (!g_world) return;
  const int rank = g_world->rank();
  const Millis timeout = g_world->timeout();
  auto store = std::dynamic_pointer_cast<TcpStore>(g_world->store());
  g_world.reset();
  // Rank 0 closes the group's store; the others wait until it has. The
  // next init() hosts a new store on the same port, and a rank that reached
  // this one instead would find its rank already claimed there, or lose the
  // connection when rank 0 closed it.
  if (store && !store->close_for_group(timeout)) {
    throw TimeoutError("cohort::finalize (rank " + std::to_string(rank) + "): " + store->server() +
                       " did not close the group's store within " +
                       std::to_string(timeout.count()) + " ms: call finalize() on every rank");
  }
}

}  // namespace cohort
