#include "cohort/comm/gloo/liveness_probe.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/core/process_identity.h"
#include "cohort/core/signature.h"
#include "cohort/core/store/prefix_store.h"
#include "cohort/core/store/tcp_store.h"

namespace cohort {

namespace {

std::string mark(int64_t seq, int rank, const char* what = "") {
  return "cohort/liveness/" + std::to_string(seq) + "/" + std::to_string(rank) + what;
}

std::string process_key(int rank) { return "cohort/liveness/process/" + std::to_string(rank); }

// The group's store as the probe uses it: where another process serves it
// (a TcpStore, reached through the PrefixStores of subgroups), each request
// waits `most` at most for its reply, so that a server that stopped is found
// out and named (server()) instead of waited for to the store's timeout.
class ProbeStore {
 public:
  ProbeStore(Store& store, Millis most) : store_(store), most_(most) {
    Store* s = &store;
    while (auto* p = dynamic_cast<PrefixStore*>(s)) {
      prefix_ = p->prefix() + "/" + prefix_;
      s = p->inner().get();
    }
    tcp_ = dynamic_cast<TcpStore*>(s);
  }
  void set(const std::string& key) {
    if (tcp_) {
      tcp_->set_within(prefix_ + key, {1}, most_);
    } else {
      store_.set(key, {1});
    }
  }
  bool check(const std::string& key) {
    return tcp_ ? tcp_->check_within({prefix_ + key}, most_) : store_.check({key});
  }
  // `key`'s value, or empty when it has none or the store fails. Only the
  // check has the deadline: a server that answered it answers the read at
  // once.
  std::string read(const std::string& key) {
    try {
      if (!check(key)) return "";
      const auto v = store_.get(key);
      return std::string(v.begin(), v.end());
    } catch (const std::exception&) {
      return "";  // the peer is then named without its process's state
    }
  }
  // Empty for a store no other process serves (in-process, file).
  std::string server() const { return tcp_ ? tcp_->server() : ""; }

 private:
  Store& store_;
  Millis most_;
  std::string prefix_;  // the PrefixStores' prefixes, outermost last
  TcpStore* tcp_ = nullptr;
};

// The ranks of `peers` without `what`'s mark for `seq`.
std::vector<int> unmarked(ProbeStore& store, const std::vector<int>& peers, int64_t seq,
                          const char* what) {
  std::vector<int> still;
  for (int q : peers) {
    if (!store.check(mark(seq, q, what))) still.push_back(q);
  }
  return still;
}

using Clock = std::chrono::steady_clock;

// What the probe says of the peers whose marks never came: those on this
// machine whose process is gone or stopped (/proc, through the words each
// rank published), then the others, which may be stopped, hung or elsewhere.
std::string silent_text(ProbeStore& store, const std::vector<int>& silent, Millis most) {
  std::vector<std::string> described;
  for (int q : silent) described.push_back(store.read(process_key(q)));
  std::vector<int> other;
  std::string text = silent_processes(silent, described, most, other);
  if (!other.empty()) {
    text += "; " + silent_peers_message(other, most, "waiting for this collective");
  }
  return text;
}

// Marks this rank's probe done, then waits until every rank that marked
// itself alive has marked done too: a peer first seen alive at time t ends
// its own probe by t + `most` (its window), so it is waited for until then
// and a second more (a loaded machine's scheduling); 3 * `most` + 1 s at
// most in all. Why: the store's server may live in this process (rank 0 under
// torchrun's variables), and a survivor that reports its error usually
// exits; leaving before the other survivors have read the marks would cut
// their probe off ("Connection reset") and leave them without a name. A
// peer's verdict is made before it marks done, so the store may go away
// during this wait (its host saw every mark and left): that ends it.
void wait_for_answering_probes(ProbeStore& store, int rank, int size, int64_t seq, Millis most,
                               std::map<int, Clock::time_point> seen, Clock::time_point start) {
  store.set(mark(seq, rank, "/done"));
  std::vector<int> peers;
  for (int q = 0; q < size; ++q) {
    if (q != rank) peers.push_back(q);
  }
  const auto cap = start + 3 * most + std::chrono::seconds(1);
  while (Clock::now() < cap) {
    // Re-read each round: a rank whose timeout came later marks itself alive
    // after this one's window ended, and still reads the marks through here.
    auto until = Clock::time_point::min();
    for (int q : unmarked(store, peers, seq, "/done")) {
      if (!seen.count(q) && store.check(mark(seq, q))) seen[q] = Clock::now();
      if (seen.count(q)) until = std::max(until, seen[q] + most + std::chrono::seconds(1));
    }
    if (Clock::now() >= until) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

void publish_process(Store& store, int rank) {
  store.set_string(process_key(rank), this_process());
}

std::string store_liveness_probe(Store& group_store, int rank, int size, int64_t seq, Millis most) {
  if (size <= 1 || seq <= 0) return "";
  ProbeStore store(group_store, most);
  try {
    store.set(mark(seq, rank));
    std::vector<int> silent;
    for (int q = 0; q < size; ++q) {
      if (q != rank) silent.push_back(q);
    }
    std::map<int, Clock::time_point> seen;  // when each peer's mark was first read
    // Polled rather than one wait per key: a single wait would stop at the
    // first silent rank and leave the later ones unchecked.
    const auto start = Clock::now();
    while (true) {
      const auto still = unmarked(store, silent, seq, "");
      for (int q : silent) {
        if (!std::count(still.begin(), still.end(), q)) seen[q] = Clock::now();
      }
      silent = still;
      if (silent.empty() || Clock::now() >= start + most) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // Worded before the wait below, while the store surely still serves.
    const auto verdict = silent.empty() ? std::string("; every peer still answers")
                                        : silent_text(store, silent, most);
    try {
      wait_for_answering_probes(store, rank, size, seq, most, std::move(seen), start);
    } catch (const std::exception&) {
      // The verdict above stands: the host left once every probe was done.
    }
    return verdict;
  } catch (const TimeoutError& e) {
    // A server that did not reply within `most` stopped answering, as a
    // silent peer does; it holds the marks, so no other rank can be asked.
    if (store.server().empty()) return std::string("; the liveness probe failed: ") + e.what();
    return "; " + store.server() + " (the store's host) did not answer within " +
           std::to_string(most.count()) +
           " ms: stopped (SIGSTOP, a debugger) or hung; the other ranks cannot be asked (" +
           e.what() + ")";
  } catch (const std::exception& e) {
    return std::string("; the liveness probe could not use the store: ") + e.what();
  }
}

}  // namespace cohort
