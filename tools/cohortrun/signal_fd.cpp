#include "signal_fd.h"

#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace cohortrun {

namespace {

bool ignored(int sig) {
  struct sigaction current {};
  return ::sigaction(sig, nullptr, &current) == 0 && current.sa_handler == SIG_IGN;
}

}  // namespace

SignalFd::SignalFd() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGCHLD, SIGINT, SIGTERM}) sigaddset(&set, sig);
  // nohup asked for the job to survive a hangup: leave SIGHUP ignored, for
  // the ranks too.
  if (!ignored(SIGHUP)) sigaddset(&set, SIGHUP);
  if (sigprocmask(SIG_BLOCK, &set, nullptr) != 0) {
    throw std::system_error(errno, std::generic_category(), "sigprocmask");
  }
  // Dispositions inherited as SIG_IGN would break the launcher (an ignored
  // SIGCHLD reaps children before waitpid sees them) and the ranks (a shell
  // starts background jobs with SIGINT ignored; a rank inheriting that could
  // not be stopped by the forwarded SIGINT). Blocked, the defaults never act
  // in the launcher itself; exec passes them on to the ranks.
  for (int sig : {SIGCHLD, SIGINT, SIGTERM}) ::signal(sig, SIG_DFL);
  fd_ = UniqueFd(signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC));
  if (!fd_.valid()) {
    throw std::system_error(errno, std::generic_category(), "signalfd");
  }
}

std::vector<int> SignalFd::take() {
  std::vector<int> sigs;
  signalfd_siginfo info;
  for (;;) {
    ssize_t n = ::read(fd_.get(), &info, sizeof info);
    if (n == static_cast<ssize_t>(sizeof info)) {
      sigs.push_back(static_cast<int>(info.ssi_signo));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return sigs;  // EAGAIN: nothing more pending
    }
  }
}

bool is_interrupt(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP; }

}  // namespace cohortrun
