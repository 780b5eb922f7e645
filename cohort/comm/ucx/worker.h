// defines: Worker (one UCX context and worker with an endpoint to every rank
// of a group), Transfer (one tagged send or receive in flight) and
// TransferWork (the WorkImpl over it).
//
// Tags: a 64-bit UCX tag is the channel (2 bits), the sender's rank (30
// bits) and the caller's tag (32 bits). Receives name their source, so they
// match on the whole tag: user messages, the engine's collective messages
// and control notices never meet. The exception is a collective's check
// (collective_check.h), received whatever its tag's low 31 bits hold.
//
// Progress: the thread that waits drives UCX (ucp_worker_progress), spinning
// briefly and then sleeping: one thread on the worker's event fd, the others
// until a completion callback wakes them. The engine's own thread sleeps the
// same way when it has no job, so a transfer also advances while every
// caller computes (see README.md).
#pragma once

#include <ATen/ATen.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/comm/ucx/collective_check.h"
#include "cohort/core/store/store.h"
#include "cohort/core/types.h"
#include "cohort/core/work.h"

namespace cohort::ucx {

using Clock = std::chrono::steady_clock;

enum class Channel : uint64_t { User = 0, Collective = 1, Control = 2 };

// Where UCX may listen and which transports it may use (see rendezvous.cpp).
struct WorkerConfig {
  std::string bind_address;  // the network address of this rank's host, or loopback
  std::string interface;     // a network interface to use instead (GLOO_SOCKET_IFNAME)
};

// How long a timed-out wait waits for its peers' answers to the liveness
// probe (worker_probe.cpp). A live peer's engine thread answers within its
// 100 ms idle slice; the rest is room for a loaded machine.
inline constexpr Millis kProbeTime{1000};

// One send or receive. Written by UCX's completion callback (status, length,
// then done) and read by waiters; the Worker frees the UCX request.
class Worker;

struct Transfer {
  Worker* owner = nullptr;  // woken by the completion callback
  at::Tensor buffer;        // keeps the memory alive while UCX may touch it
  int peer = -1;
  int tag = 0;
  Channel channel = Channel::User;
  bool is_send = false;
  size_t bytes = 0;  // the buffer's size
  std::atomic<bool> done{false};
  ucs_status_t status = UCS_OK;
  size_t received = 0;      // a receive's message length
  uint64_t sender_tag = 0;  // a receive's message tag
  bool check = false;       // a receive in the check slot (collective_check.h)
  bool verified = false;    // a check compared with this rank's collective
  void* request = nullptr;  // UCX's request while not freed (Worker only)

  // "receive from rank 1 (tag 3)"
  std::string what() const;
};

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

  // Posts a transfer of `t` (contiguous, CPU). Throws PeerError when the
  // group already failed.
  std::shared_ptr<Transfer> post(Channel channel, at::Tensor t, int peer, int tag, bool is_send);
  // Drives UCX until `t` is done or `deadline`; throws TimeoutError,
  // PeerError (dead peer, transport error) or MismatchError (a message
  // longer or shorter than the receive buffer, on either rank).
  void wait(Transfer& t, Clock::time_point deadline);
  // Progresses UCX once; true when something happened.
  bool progress();
  // The engine's thread between jobs: progresses UCX, then sleeps at most
  // `most` (on the event fd while transfers are pending and nobody waits).
  void idle(Millis most);
  // Wakes the threads sleeping in idle or wait.
  void signal();
  // While one lives, this thread drives UCX (it runs a collective inline and
  // waits for each message it posts): posts do not wake the engine's
  // thread, and idle() does not arm the event fd (see README.md).
  class Driving {
   public:
    explicit Driving(Worker& w) : n_(w.waiters_) { n_.fetch_add(1, std::memory_order_acq_rel); }
    ~Driving() { n_.fetch_sub(1, std::memory_order_acq_rel); }
    Driving(const Driving&) = delete;
    Driving& operator=(const Driving&) = delete;

   private:
    std::atomic<int>& n_;
  };
  // Called by UCX's completion callbacks: counts `t` done, wakes waiters.
  void completed(const Transfer& t);

  // The collective this rank runs next (collective_check.h): its checks are
  // watched by every wait for the engine's collective messages. Called by
  // the thread that runs the collective, which alone calls the three below.
  // An all_to_all gives the elements it sends to and expects from each
  // peer (d.count is then per peer). Throws MismatchError when a peer
  // closed after fewer collectives.
  void begin_collective(const Descriptor& d, std::vector<int64_t> send_counts = {},
                        std::vector<int64_t> recv_counts = {});
  // Sends this rank's descriptor to every other rank, receives theirs.
  void post_check();
  // A receive in the check slot from `peer` into `t` (at least a check
  // message long), watched as the collective's check: a fused message.
  std::shared_ptr<Transfer> post_check_receive(at::Tensor t, int peer);
  // Waits for the check (MismatchError naming both collectives when it
  // differs) and ends the collective; `ok` false (a failed collective)
  // only ends it.
  void end_collective(Clock::time_point deadline, bool ok);

 private:
  class Exchange;  // the rendezvous's stages through the store (worker_setup.cpp)
  void rendezvous(Exchange& exchange, const WorkerConfig& config);
  // post() without the failed-group check (the notice of report_bad_receive).
  // A receive matches the tag's bits in `mask` (a check: all but the low 31).
  std::shared_ptr<Transfer> start(Channel channel, at::Tensor t, int peer, int tag, bool is_send,
                                  uint64_t mask = ~uint64_t{0});
  void create_endpoints(const std::vector<std::vector<uint8_t>>& addresses);
  // Notices on the control channel: a type word, then its fields
  // (worker.cpp); at most two ranks and their descriptors.
  static constexpr int kNoticeWords = 3 + 2 * kDescriptorWords;
  enum Notice : int64_t { kTruncated = 1, kMismatch = 2, kClosed = 3, kPing = 4, kPong = 5 };
  void post_control_receive();
  // Turns a peer's notice or an endpoint error into the group's failure.
  void check_notices();
  void handle_notices();
  // Whether `peer` announced that it closed its communicator cleanly.
  bool closed_cleanly(int peer);
  // How many collectives `peer` ran before it closed (INT64_MAX while open).
  int64_t closed_after(int peer);
  // The liveness probe (worker_probe.cpp): asks every open peer whether it
  // still answers and waits up to `most`; returns what to add to a timeout's
  // message, naming the peers that did not answer.
  std::string probe_peers(Millis most);
  void answer_ping(int peer, int64_t round);
  void record_pong(int peer, int64_t round);
  void report_bad_receive(const Transfer& t);
  // The check of the current collective, compared once it arrived.
  void verify_check(Transfer& t);
  // Compares the checks that arrived and are not compared yet.
  void verify_arrived();
  // This rank's descriptor as sent to `peer`, or as expected from it
  // (they differ only in an all_to_all's count).
  Descriptor for_peer(int peer, bool sent);
  // Fails the group naming both collectives, tells every peer.
  [[noreturn]] void mismatch(int peer, const Descriptor& theirs);
  void handle_notice(const int64_t* w, size_t words);
  void notify_all(const at::Tensor& notice);
  // "collective #3 (this rank called all_reduce (...))", or "" between collectives.
  std::string current_locked() const;
  void fail(const std::string& why, bool mismatch);
  [[noreturn]] void throw_failure();
  // Throws unless `t` succeeded with the expected length.
  void finish(Transfer& t);
  // Sleeps until `done` (if given), an event, or `most`.
  void block(const std::atomic<bool>* done, Millis most);
  void prune_locked();
  void close();
  static void on_peer_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  int rank_;
  int size_;
  bool single_host_ = false;
  std::string transports_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::vector<ucp_ep_h> endpoints_;
  // An endpoint's error-callback argument. The callback runs inside UCX's
  // progress (under UCX's worker lock), so it only records; waiters turn it
  // into the group's failure.
  struct PeerSlot {
    Worker* self = nullptr;
    int rank = -1;
    std::atomic<int> status{UCS_OK};
  };
  std::unique_ptr<PeerSlot[]> peer_slots_;
  // Per peer, the last probe round it answered; the current round.
  std::unique_ptr<std::atomic<int64_t>[]> answered_;
  std::atomic<int64_t> probe_round_{0};
  std::atomic<bool> peer_failed_{false};

  void wake_all();   // the threads waiting for a completion
  void wake_idle();  // the engine's thread in idle()

  std::atomic<bool> sleeper_{false};  // a thread sleeps on event_fd_
  std::atomic<int> waiters_{0};       // threads inside wait()
  std::atomic<int> blocked_{0};       // threads asleep on wake_ in block()
  std::atomic<int> pending_{0};       // posted transfers not yet complete (not control)
  std::mutex idle_mu_;
  std::condition_variable idle_;
  uint64_t idle_generation_ = 0;  // under idle_mu_: bumped by wake_idle
  std::mutex wake_mu_;
  std::condition_variable wake_;
  std::mutex mu_;  // inflight_, failure_
  std::vector<std::shared_ptr<Transfer>> inflight_;
  std::string failure_;  // the first error of the group; later operations fail with it
  bool failure_is_mismatch_ = false;
  std::atomic<bool> failed_{false};
  // A notice from a peer: a receive that did not fit (report_bad_receive),
  // collectives that differ (mismatch), or a peer that closed (close).
  // Read without a lock: every control receive stays alive in controls_
  // (under mu_) until the close; there are a few per peer at most. The
  // one thread that handles a notice and reposts holds control_mu_.
  std::atomic<Transfer*> control_{nullptr};
  std::vector<std::shared_ptr<Transfer>> controls_;
  std::mutex control_mu_;

  // The current collective (under mu_), and how many collectives each peer
  // ran before it closed (under mu_; INT64_MAX while open), and whether it
  // closed cleanly (under mu_).
  Descriptor current_;
  bool in_collective_ = false;
  int64_t collectives_ = 0;  // begun by this rank
  std::vector<int64_t> closed_after_;
  std::vector<bool> closed_clean_;
  // The current collective's check messages, and an all_to_all's counts per
  // peer (the collective's thread only).
  std::vector<std::shared_ptr<Transfer>> checks_in_, checks_out_;
  std::vector<int64_t> send_counts_, recv_counts_;
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
