#include "rendezvous.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "cohort/core/error.h"
#include "job_token.h"
#include "output.h"

namespace cohortrun {
namespace {

using Clock = std::chrono::steady_clock;
using cohort::Millis;

Millis millis(double seconds) { return Millis(static_cast<int64_t>(seconds * 1000)); }

// How often a launcher looks at the store while it waits or its ranks run:
// short next to every timeout it serves.
Millis poll_period(const Options& o) {
  return std::min(Millis(250), millis(o.heartbeat_timeout_s / 4));
}

std::string token_from_environment() {
  const char* t = std::getenv("COHORT_STORE_TOKEN");
  return t ? t : "";
}

// "3" -> 3; anything else stored under our keys is a broken job.
int to_int(const std::string& text, const std::string& what) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < 0 || v > (1 << 30)) {
    throw cohort::Error("rendezvous: bad " + what + " '" + text + "' in the store");
  }
  return static_cast<int>(v);
}

const char* kind_tag(EndKind k) {
  return k == EndKind::kJoin ? "join" : k == EndKind::kLost ? "lost" : "fail";
}

}  // namespace

Rendezvous::Rendezvous(const Options& options)
    : options_(options),
      prefix_("cohortrun/" + options.rdzv_id + "/"),
      token_(token_from_environment()) {
  // Without the user's token, launchers that all run on this machine share
  // one the host makes (job_token.h); across machines the store stays open.
  const bool local = token_.empty() && cohort::net::is_loopback(options.master_addr);
  if (local) token_ = new_job_token();
  if (token_.empty()) {
    log_line("warning: COHORT_STORE_TOKEN is not set: the launchers' store on " +
             options.master_addr + ":" + std::to_string(options.master_port) +
             " and the ranks' store on the next port accept any client that reaches them. Set "
             "the same secret in COHORT_STORE_TOKEN on every node.");
  }
  // The launcher on --master-addr's host can bind it and hosts the store;
  // elsewhere the bind fails (the address is not ours, or a launcher of this
  // machine already serves it) and this one is a client.
  try {
    store_ = std::make_unique<cohort::TcpStore>(options.master_addr,
                                                static_cast<uint16_t>(options.master_port), true,
                                                millis(options.rdzv_timeout_s), token_);
    host_ = true;
  } catch (const cohort::Error&) {
    connect_as_client(local);
  }
  if (host_ && local) write_token_file(token_file(options), token_);
  // Replies to single requests come at once from a live host; waiting for
  // members is bounded by wait()'s own timeout below.
  store_->set_timeout(std::max(millis(options.heartbeat_timeout_s), Millis(1000)));
}

void Rendezvous::connect_as_client(bool local) {
  const auto port = static_cast<uint16_t>(options_.master_port);
  const Millis timeout = millis(options_.rdzv_timeout_s);
  if (!local) {
    store_ = std::make_unique<cohort::TcpStore>(options_.master_addr, port, false, timeout, token_);
    return;
  }
  // The host writes its token once it serves; a file left by an earlier job
  // holds another one, which the store refuses: read it again until then.
  const std::string path = token_file(options_);
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::string why = "no token in " + path;
    if (auto t = read_token_file(path)) {
      try {
        store_ = std::make_unique<cohort::TcpStore>(options_.master_addr, port, false, timeout, *t);
        token_ = *t;
        return;
      } catch (const cohort::PeerError& e) {
        why = e.what();
      }
    }
    if (Clock::now() >= deadline) {
      throw cohort::TimeoutError("rendezvous: the host's store on " + options_.master_addr + ":" +
                                 std::to_string(port) +
                                 " did not take this machine's job token "
                                 "within --rdzv-timeout: " +
                                 why);
    }
    std::this_thread::sleep_for(poll_period(options_));
  }
}

std::string Rendezvous::key(int generation, const std::string& name) const {
  return prefix_ + std::to_string(generation) + "/" + name;
}

int Rendezvous::open_generation() {
  store_->wait({prefix_ + "open"}, millis(options_.rdzv_timeout_s));
  return to_int(store_->get_string(prefix_ + "open"), "generation");
}

int Rendezvous::wait_for_later_generation(int generation) {
  const auto deadline = Clock::now() + millis(options_.rdzv_timeout_s);
  for (;;) {
    const int open = open_generation();
    if (open > generation) return open;
    if (Clock::now() >= deadline) {
      throw cohort::TimeoutError("rendezvous: waited " + std::to_string(options_.rdzv_timeout_s) +
                                 " s to join a generation after " + std::to_string(generation) +
                                 " (is the job at --nnodes MAX?)");
    }
    std::this_thread::sleep_for(poll_period(options_));
  }
}

Membership Rendezvous::join(int generation) {
  for (;;) {
    if (host_) {
      generation = std::max(generation, 0);
      store_->set_string(prefix_ + "open", std::to_string(generation));
    } else {
      generation = std::max(generation, open_generation());
    }
    const int slot = static_cast<int>(store_->add(key(generation, "joined"), 1));
    store_->set_string(key(generation, "node/" + std::to_string(slot)),
                       std::to_string(options_.nproc_per_node));
    const std::string members_key = key(generation, "members");
    if (host_) {
      store_->set_string(members_key, close(generation, slot));
    } else {
      store_->wait({members_key}, millis(options_.rdzv_timeout_s));
    }
    Membership m;
    m.generation = generation;
    m.slot = slot;
    int first = 0;
    bool member = false;
    // "slot:nproc,slot:nproc,...", host first.
    std::istringstream in(store_->get_string(members_key));
    for (std::string item; std::getline(in, item, ',');) {
      const auto colon = item.find(':');
      if (colon == std::string::npos) throw cohort::Error("rendezvous: bad members '" + item + "'");
      const int s = to_int(item.substr(0, colon), "slot");
      const int nproc = to_int(item.substr(colon + 1), "rank count");
      if (s == slot) {
        member = true;
        m.node_rank = static_cast<int>(m.member_slots.size());
        m.first_rank = first;
      }
      m.member_slots.push_back(s);
      first += nproc;
    }
    m.nnodes = static_cast<int>(m.member_slots.size());
    m.world = first;
    if (member) return m;
    // Arrived after the generation closed: the host sees a node waiting and
    // ends the running generation when there is room.
    log_line("rendezvous: generation " + std::to_string(generation) +
             " is closed; waiting to join the next");
    generation = wait_for_later_generation(generation);
  }
}

// The host decides the members: every node that joined, up to --nnodes MAX,
// once MAX joined or MIN joined and the last call passed. Host first, so
// that rank 0 (and the ranks' store) lives where --master-addr points.
std::string Rendezvous::close(int generation, int host_slot) {
  const auto deadline = Clock::now() + millis(options_.rdzv_timeout_s);
  auto last_call = Clock::time_point::max();
  int joined = 0;
  for (;;) {
    joined = static_cast<int>(store_->add(key(generation, "joined"), 0));
    const auto now = Clock::now();
    if (joined >= options_.nnodes) break;
    if (joined >= options_.min_nnodes) {
      if (last_call == Clock::time_point::max()) last_call = now + millis(options_.last_call_s);
      if (now >= last_call) break;
    }
    if (now >= deadline) {
      throw cohort::TimeoutError("rendezvous: " + std::to_string(joined) + " of at least " +
                                 std::to_string(options_.min_nnodes) + " nodes joined generation " +
                                 std::to_string(generation) + " within " +
                                 std::to_string(options_.rdzv_timeout_s) + " s");
    }
    std::this_thread::sleep_for(poll_period(options_));
  }
  std::string members = std::to_string(host_slot) + ":" + std::to_string(options_.nproc_per_node);
  int count = 1;
  for (int s = 1; s <= joined && count < options_.nnodes; ++s) {
    if (s == host_slot) continue;
    const std::string node = key(generation, "node/" + std::to_string(s));
    // A node that died between taking its ticket and describing itself is
    // left out rather than waited for.
    try {
      store_->wait({node}, Millis(2000));
    } catch (const cohort::TimeoutError&) {
      continue;
    }
    members += "," + std::to_string(s) + ":" +
               std::to_string(to_int(store_->get_string(node), "rank count"));
    ++count;
  }
  return members;
}

void Rendezvous::end(int generation, EndKind kind, const std::string& cause) {
  // The first to end it names the cause; later ones only agree.
  if (store_->add(key(generation, "end_count"), 1) == 1) {
    store_->set_string(key(generation, "end"), std::string(kind_tag(kind)) + ":" + cause);
  }
}

bool Rendezvous::ended(int generation, EndKind* kind, std::string* cause) {
  const std::string k = key(generation, "end");
  if (!store_->check({k})) return false;
  const std::string v = store_->get_string(k);
  const std::string tag = v.substr(0, 4);
  *kind = tag == "join" ? EndKind::kJoin : tag == "lost" ? EndKind::kLost : EndKind::kFailure;
  *cause = v.size() > 5 ? v.substr(5) : v;
  return true;
}

void Rendezvous::report_done(const Membership& m) {
  store_->set_string(key(m.generation, "done/" + std::to_string(m.slot)), "1");
}

void Rendezvous::wait_for_members_done(const Membership& m) {
  std::map<int, std::pair<int64_t, Clock::time_point>> beats;
  for (;;) {
    bool all = true;
    const auto now = Clock::now();
    for (int s : m.member_slots) {
      if (store_->check({key(m.generation, "done/" + std::to_string(s))})) continue;
      const int64_t beat = store_->add(key(m.generation, "hb/" + std::to_string(s)), 0);
      auto it = beats.find(s);
      if (it == beats.end() || it->second.first != beat) {
        beats[s] = {beat, now};
      } else if (now - it->second.second > millis(options_.heartbeat_timeout_s)) {
        continue;  // silent: not waited for
      }
      all = false;
    }
    if (all) return;
    std::this_thread::sleep_for(poll_period(options_));
  }
}

Watch::Watch(Rendezvous& rdzv, const Membership& m) : rdzv_(rdzv), m_(m) {
  const auto now = Clock::now();
  for (int s : m.member_slots) last_beat_[s] = {-1, now};
  thread_ = std::thread([this] { run(); });
}

Watch::~Watch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watch::run() {
  const std::string beat = rdzv_.key(m_.generation, "hb/" + std::to_string(m_.slot));
  const Millis period = poll_period(rdzv_.options());
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    try {
      rdzv_.store().add(beat, 1);
      EndKind kind;
      std::string cause;
      if (rdzv_.ended(m_.generation, &kind, &cause)) {
        end_requested_ = true;
        return;
      }
      if (rdzv_.is_host()) host_checks();
    } catch (const std::exception& e) {
      // The host (and its store) is gone or hung: the ranks cannot go on.
      log_line(std::string("rendezvous: lost the store: ") + e.what());
      end_requested_ = true;
      return;
    }
    lock.lock();
    cv_.wait_for(lock, period, [this] { return stop_; });
  }
}

void Watch::host_checks() {
  auto& store = rdzv_.store();
  const int joined = static_cast<int>(store.add(rdzv_.key(m_.generation, "joined"), 0));
  if (m_.nnodes < rdzv_.options().nnodes) {
    for (int s = 1; s <= joined; ++s) {
      if (std::find(m_.member_slots.begin(), m_.member_slots.end(), s) != m_.member_slots.end()) {
        continue;
      }
      // A ticket without a description is a node that died while joining:
      // no reason to restart.
      if (store.check({rdzv_.key(m_.generation, "node/" + std::to_string(s))})) {
        rdzv_.end(m_.generation, EndKind::kJoin, "a node is waiting to join");
        return;
      }
    }
  }
  const auto now = Clock::now();
  const auto limit = millis(rdzv_.options().heartbeat_timeout_s);
  for (size_t i = 0; i < m_.member_slots.size(); ++i) {
    const int s = m_.member_slots[i];
    if (s == m_.slot) continue;
    if (store.check({rdzv_.key(m_.generation, "done/" + std::to_string(s))})) continue;
    const int64_t count = store.add(rdzv_.key(m_.generation, "hb/" + std::to_string(s)), 0);
    auto& [last, seen] = last_beat_[s];
    if (count != last) {
      last = count;
      seen = now;
    } else if (now - seen > limit) {
      std::ostringstream why;
      why << "node " << i << " sent no heartbeat for " << rdzv_.options().heartbeat_timeout_s
          << " s";
      rdzv_.end(m_.generation, EndKind::kLost, why.str());
      return;
    }
  }
}

}  // namespace cohortrun
