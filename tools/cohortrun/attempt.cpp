#include "attempt.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "output.h"
#include "process_tree.h"
#include "rank_env.h"
#include "report.h"
#include "spawn.h"

namespace cohortrun {

Attempt::Attempt(const Options& options, SignalFd& signals, int restart, int master_port,
                 const std::atomic<bool>* end_requested, UniqueFd store_listener)
    : options_(options),
      signals_(signals),
      restart_(restart),
      master_port_(master_port),
      store_listener_(std::move(store_listener)),
      end_requested_(end_requested) {}

AttemptResult Attempt::run() {
  spawn_all();
  if (options_.timeout_s > 0) {
    job_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(options_.timeout_s));
  }
  while (!finished()) {
    wait_for_events();
    check_deadlines();
    if (phase_ == Phase::kRunning && end_requested_ != nullptr && end_requested_->load()) {
      ended_ = true;
      begin_teardown(SIGTERM);
    }
    // With every rank exited, whatever is left in their groups (a helper
    // started in the background) has outlived the job: stop it.
    if (phase_ == Phase::kRunning && !any_running()) {
      begin_teardown(SIGTERM);
    }
  }
  kill_stray_children();

  if (interrupt_ == 0 && failed_ >= 0) {
    const Rank& r = ranks_[failed_];
    report_failure(r.rank, r.status, r.output);
  }
  return result();
}

void Attempt::spawn_all() {
  const int n = options_.nproc_per_node;
  ranks_.reserve(n);
  for (int local = 0; local < n; ++local) {
    const int rank = options_.first_rank() + local;
    ranks_.emplace_back(rank, !options_.quiet_others || rank == 0);
  }
  for (int local = 0; local < n; ++local) {
    Rank& r = ranks_[local];
    try {
      const int store_fd = r.rank == 0 ? store_listener_.get() : -1;
      RankProcess p =
          spawn_rank(options_.command,
                     rank_environment(options_, local, restart_, master_port_, store_fd), store_fd);
      if (store_fd >= 0) store_listener_.reset();  // rank 0 holds it now
      r.pid = p.pid;
      r.running = true;
      r.out = std::move(p.out);
      r.err = std::move(p.err);
    } catch (const std::system_error& e) {
      // The ranks already started would wait forever for this one.
      spawn_error_ = "cannot start rank " + std::to_string(r.rank) + ": " + e.what();
      log_line(spawn_error_);
      begin_teardown(SIGTERM);
      return;
    }
  }
}

void Attempt::wait_for_events() {
  std::vector<pollfd> fds{{signals_.fd(), POLLIN, 0}};
  std::vector<std::pair<Rank*, Stream>> sources;
  for (Rank& r : ranks_) {
    if (r.out.valid()) {
      fds.push_back({r.out.get(), POLLIN, 0});
      sources.emplace_back(&r, Stream::kOut);
    }
    if (r.err.valid()) {
      fds.push_back({r.err.get(), POLLIN, 0});
      sources.emplace_back(&r, Stream::kErr);
    }
  }
  int n = ::poll(fds.data(), fds.size(), poll_timeout_ms());
  if (n < 0) {
    if (errno == EINTR) return;
    throw std::system_error(errno, std::generic_category(), "poll");
  }
  // One read per ready pipe per round keeps a chatty rank from starving
  // the others.
  for (size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents != 0) {
      read_output(*sources[i - 1].first, sources[i - 1].second);
    }
  }
  if (fds[0].revents != 0) on_signals();
}

void Attempt::read_output(Rank& rank, Stream stream) {
  UniqueFd& fd = stream == Stream::kOut ? rank.out : rank.err;
  char buf[64 * 1024];
  ssize_t n = ::read(fd.get(), buf, sizeof buf);
  if (n > 0) {
    rank.output.on_bytes(stream, std::string_view(buf, n));
  } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
    rank.output.on_eof(stream);
    fd.reset();
  }
}

void Attempt::on_signals() {
  for (int sig : signals_.take()) {
    if (is_interrupt(sig)) on_interrupt(sig);
  }
  // Always reap: SIGCHLDs coalesce, and one may be pending behind others.
  reap();
}

void Attempt::on_interrupt(int sig) {
  const bool first = interrupt_ == 0;
  if (first) interrupt_ = sig;
  if (phase_ == Phase::kRunning) {
    log_line("received " + signal_name(sig) + "; forwarding it to the ranks");
    begin_teardown(sig);
  } else if (phase_ == Phase::kTerminating) {
    // A request while ranks shut down (after an earlier one, or a failed
    // rank or the timeout): the user will not wait.
    log_line("received " + signal_name(sig) + (first ? " while the ranks shut down" : " again") +
             "; killing the ranks");
    kill_all();
  }
}

void Attempt::reap() {
  // Ranks that exited since the last round, in the order they exited:
  // several may have failed before this round (ranks failing close
  // together), and the one to name is the first. waitpid(-1) would hand
  // them over in spawn order.
  std::vector<std::pair<double, size_t>> exited;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    siginfo_t info{};
    if (ranks_[i].running &&
        ::waitid(P_PID, ranks_[i].pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
        info.si_pid == ranks_[i].pid) {
      exited.emplace_back(last_ran_ms(ranks_[i].pid), i);
    }
  }
  std::stable_sort(exited.begin(), exited.end());
  for (const auto& [when, i] : exited) {
    int status = 0;
    while (::waitpid(ranks_[i].pid, &status, 0) < 0 && errno == EINTR) {
    }
    on_rank_exit(i, status);
  }
  for (;;) {
    int status = 0;
    pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno == EINTR) continue;
    if (pid <= 0) return;
    for (size_t i = 0; i < ranks_.size(); ++i) {
      if (ranks_[i].pid == pid && ranks_[i].running) on_rank_exit(i, status);
    }
    // Any other pid is an orphan reparented to us (we are a subreaper):
    // reaping it is all there is to do.
  }
}

void Attempt::on_rank_exit(size_t i, int status) {
  Rank& r = ranks_[i];
  r.running = false;
  r.status = ExitStatus(status);
  if (phase_ == Phase::kRunning && r.status.failed()) {
    failed_ = static_cast<int>(i);
    begin_teardown(SIGTERM);
  } else if (phase_ == Phase::kTerminating) {
    // What the rank leaves behind is orphaned now; it may ignore the
    // forwarded signal (background jobs of a shell ignore SIGINT).
    ::kill(-r.pid, SIGTERM);
  }
}

void Attempt::check_deadlines() {
  const Clock::time_point now = Clock::now();
  if (phase_ == Phase::kRunning && now >= job_deadline_) {
    on_timeout();
  } else if (phase_ == Phase::kTerminating && now >= phase_deadline_) {
    kill_all();
  } else if (phase_ == Phase::kKilling && now >= phase_deadline_) {
    // Only a process that left its group can still hold a pipe here; its
    // output is not worth hanging the launcher for.
    log_line(
        "some processes of the job did not exit after SIGKILL; not "
        "waiting for them");
    for (Rank& r : ranks_) {
      if (r.out.valid()) r.output.on_eof(Stream::kOut);
      if (r.err.valid()) r.output.on_eof(Stream::kErr);
      r.out.reset();
      r.err.reset();
    }
    phase_ = Phase::kAbandoned;
  }
}

void Attempt::on_timeout() {
  timed_out_ = true;
  std::vector<RunningRank> running;
  for (const Rank& r : ranks_) {
    if (r.running) running.push_back({r.rank, &r.output});
  }
  report_timeout(options_.timeout_text, running);
  begin_teardown(SIGTERM);
}

void Attempt::begin_teardown(int sig) {
  phase_ = Phase::kTerminating;
  phase_deadline_ = Clock::now() + kGrace;
  signal_groups(sig);
}

void Attempt::kill_all() {
  phase_ = Phase::kKilling;
  phase_deadline_ = Clock::now() + kKillWait;
  signal_groups(SIGKILL);
}

void Attempt::signal_groups(int sig) {
  // A reaped rank's pid stays reserved while it names a live process
  // group, so signalling -pid never hits an unrelated process.
  for (const Rank& r : ranks_) {
    if (r.pid > 0) ::kill(-r.pid, sig);
  }
}

bool Attempt::any_running() const {
  for (const Rank& r : ranks_) {
    if (r.running) return true;
  }
  return false;
}

bool Attempt::finished() const {
  if (phase_ == Phase::kAbandoned) return !any_running();
  for (const Rank& r : ranks_) {
    if (r.running || r.out.valid() || r.err.valid()) return false;
    if (r.pid > 0 && ::kill(-r.pid, 0) == 0) return false;  // leftovers
  }
  return true;
}

int Attempt::poll_timeout_ms() const {
  Clock::time_point deadline = phase_ == Phase::kRunning ? job_deadline_ : phase_deadline_;
  // While running, look at end_requested this often.
  const int watch_ms = end_requested_ != nullptr && phase_ == Phase::kRunning ? 100 : -1;
  if (phase_ == Phase::kAbandoned || deadline == Clock::time_point::max()) {
    return watch_ms;
  }
  auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  // Round up: waking a hair early would only spin until the deadline.
  const int ms = static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
  return watch_ms < 0 ? ms : std::min(ms, watch_ms);
}

AttemptResult Attempt::result() const {
  AttemptResult r;
  if (interrupt_ != 0) {
    r.outcome = Outcome::kInterrupted;
    r.exit_code = 128 + interrupt_;
    r.cause = "received " + signal_name(interrupt_);
  } else if (failed_ >= 0) {
    const Rank& rank = ranks_[failed_];
    r.outcome = Outcome::kRankFailed;
    r.exit_code = rank.status.exit_code();
    r.failed_rank = rank.rank;
    r.cause = "rank " + std::to_string(rank.rank) + " " + rank.status.describe();
  } else if (ended_) {
    r.outcome = Outcome::kEnded;
    r.exit_code = 1;
    r.cause = "the generation ended";
  } else if (timed_out_) {
    r.outcome = Outcome::kTimedOut;
    r.exit_code = kTimeoutExitCode;
    r.cause = "job exceeded --timeout " + options_.timeout_text + " s";
  } else if (!spawn_error_.empty()) {
    r.outcome = Outcome::kRankFailed;
    r.exit_code = 1;
    r.cause = spawn_error_;
  }
  return r;
}

}  // namespace cohortrun
