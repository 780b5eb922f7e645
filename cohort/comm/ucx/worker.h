// defines: Worker (one UCX context and worker with an endpoint to every rank
// of a group) and TransferWork (the WorkImpl over a Transfer).
//
// The Worker is the transport (the endpoints, posting, the in-flight list,
// a wait's outcome) composed of parts, each with its own locking rule in
// its header:
// - Progress (progress.h): who drives UCX, spinning then sleeping;
// - ControlChannel (control_channel.h): notices between ranks, closes, the
//   liveness probe;
// - CollectiveCheck (collective_check.h): each collective's signature check;
// - GroupFailure (failure.h): the group's first error.
//
// Tags (transfer.h): receives name their source, so they match on the whole
// tag: user messages, the engine's collective messages and control notices
// never meet. The exceptions are a collective's check, received whatever
// its tag's low 31 bits hold, and the control receive, from any sender.
//
// Locking rule of the Worker itself: mu_ guards the in-flight list and the
// freeing and cancelling of UCX requests; it is held only around the list
// (never while a part's lock is taken or UCX progresses). The endpoints are
// written by the constructor and read-only after. Parts' locks are never
// nested: a notice's handler (ControlChannel's lock) may take
// CollectiveCheck's and GroupFailure's, nothing takes them the other way.
#pragma once

#include <ATen/ATen.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/comm/ucx/collective_check.h"
#include "cohort/comm/ucx/control_channel.h"
#include "cohort/comm/ucx/failure.h"
#include "cohort/comm/ucx/progress.h"
#include "cohort/comm/ucx/transfer.h"
#include "cohort/core/store/store.h"
#include "cohort/core/types.h"
#include "cohort/core/work.h"

namespace cohort::ucx {

// Where UCX may listen and which transports it may use (see rendezvous.cpp).
struct WorkerConfig {
  std::string bind_address;  // the network address of this rank's host, or loopback
  std::string interface;     // a network interface to use instead (GLOO_SOCKET_IFNAME)
};

// How long a timed-out wait waits for its peers' answers to the liveness
// probe (ControlChannel::probe). A live peer's engine thread answers within
// its 100 ms idle slice; the rest is room for a loaded machine.
inline constexpr Millis kProbeTime{1000};

class Worker {
 public:
  // Collective over the `size` ranks that share `store`: publishes this
  // rank's host and UCX address, reads everyone's, creates the endpoints.
  Worker(Store& store, int rank, int size, const WorkerConfig& config, Millis timeout);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // True when every rank runs on this host: UCX then uses shared memory only.
  bool single_host() const { return single_host_; }
  // The transports UCX was allowed ("self,sm", or UCX's default).
  const std::string& transports() const { return transports_; }

  // Posts a transfer of `t` (contiguous, CPU). `dtype` (a user message's
  // at::ScalarType as the caller gave it, or -1) goes in a send's tag and is
  // compared with a receive's sender's. Throws PeerError when the group
  // already failed.
  std::shared_ptr<Transfer> post(Channel channel, at::Tensor t, int peer, int tag, bool is_send,
                                 int dtype = -1);
  // Drives UCX until `t` is done or `deadline`; throws TimeoutError,
  // PeerError (dead peer, transport error) or MismatchError (a message
  // longer or shorter than the receive buffer, or of another dtype, on
  // either rank).
  void wait(Transfer& t, Clock::time_point deadline);
  // Progresses UCX once; true when something happened.
  bool progress() { return progress_.poll(); }
  // The engine's thread between jobs: progresses UCX, answers notices, then
  // sleeps at most `most` (Progress::idle_sleep).
  void idle(Millis most);
  // Wakes the threads sleeping in idle or wait.
  void signal() { progress_.signal(); }
  // While one lives, this thread drives UCX (it runs a collective inline and
  // waits for each message it posts): posts do not wake the engine's
  // thread, and idle() does not arm the event fd (see README.md).
  class Driving : public Progress::Driving {
   public:
    explicit Driving(Worker& w) : Progress::Driving(w.progress_) {}
  };
  // Called by UCX's completion callbacks.
  void completed(const Transfer& t) { progress_.completed(t.channel != Channel::Control); }

  // The collective this rank runs next (CollectiveCheck): its checks are
  // watched by every wait for the engine's collective messages. Called by
  // the thread that runs the collective, which alone calls the three below.
  void begin_collective(const Descriptor& d, std::vector<int64_t> send_counts = {},
                        std::vector<int64_t> recv_counts = {}) {
    check_.begin(d, std::move(send_counts), std::move(recv_counts));
  }
  void post_check() { check_.post(); }
  std::shared_ptr<Transfer> post_check_receive(at::Tensor t, int peer) {
    return check_.post_receive(std::move(t), peer);
  }
  void end_collective(Clock::time_point deadline, bool ok) { check_.end(deadline, ok); }

 private:
  friend class ControlChannel;
  friend class CollectiveCheck;
  class Exchange;  // the rendezvous's stages through the store (worker_setup.cpp)
  void rendezvous(Exchange& exchange, const WorkerConfig& config);
  // post() without the failed-group check (notices, checks). A receive
  // matches the tag's bits in `mask`, never the dtype field.
  std::shared_ptr<Transfer> start(Channel channel, at::Tensor t, int peer, int tag, bool is_send,
                                  uint64_t mask = ~uint64_t{0}, int dtype = -1);
  void create_endpoints(const std::vector<std::vector<uint8_t>>& addresses);
  // Turns a peer's notice or an endpoint error into the group's failure.
  void check_notices();
  void report_bad_receive(const Transfer& t);
  // Throws unless `t` succeeded with the expected length and dtype.
  void finish(Transfer& t);
  void prune_locked();
  void close();
  static void on_peer_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  const int rank_;
  const int size_;
  bool single_host_ = false;
  std::string transports_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> endpoints_;
  // Each rank's process (this_process()), published in the rendezvous: the
  // liveness probe's words for a silent peer.
  std::vector<std::string> processes_;
  // An endpoint's error-callback argument. The callback runs inside UCX's
  // progress (under UCX's worker lock), so it only records; waiters turn it
  // into the group's failure.
  struct PeerSlot {
    Worker* self = nullptr;
    int rank = -1;
    std::atomic<int> status{UCS_OK};
  };
  std::unique_ptr<PeerSlot[]> peer_slots_;
  std::atomic<bool> peer_failed_{false};
  std::mutex mu_;
  std::vector<std::shared_ptr<Transfer>> inflight_;  // under mu_

  Progress progress_;
  GroupFailure failure_;
  ControlChannel control_;
  CollectiveCheck check_;
};

// Holds the worker: a Work may outlive its engine.
class TransferWork : public WorkImpl {
 public:
  TransferWork(std::shared_ptr<Worker> worker, std::shared_ptr<Transfer> t)
      : worker_(std::move(worker)), transfer_(std::move(t)) {}
  bool is_completed() override;
  void wait(Millis timeout) override;

 private:
  std::shared_ptr<Worker> worker_;
  std::shared_ptr<Transfer> transfer_;
};

}  // namespace cohort::ucx
