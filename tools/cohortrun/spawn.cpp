#include "spawn.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>

namespace cohortrun {
namespace {

[[noreturn]] void fail(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

struct Pipe {
  UniqueFd read;
  UniqueFd write;
};

// Close-on-exec on both ends: a rank must not inherit the pipes of the
// ranks spawned before it, or their EOF would wait for it too.
Pipe make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) fail("pipe2");
  Pipe p{UniqueFd(fds[0]), UniqueFd(fds[1])};
  int flags = ::fcntl(p.read.get(), F_GETFL);
  ::fcntl(p.read.get(), F_SETFL, flags | O_NONBLOCK);
  return p;
}

std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (const std::string& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// Runs in the forked child; only raw system calls from here to exec.
[[noreturn]] void exec_child(pid_t launcher, int in, int out, int err, int inherit_fd,
                             char* const argv[], char* const envp[]) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The launcher may have died before prctl took effect; then no signal
  // will ever come, so check by hand.
  if (::getppid() != launcher) ::_exit(1);

  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);  // undo SignalFd's blocking
  ::signal(SIGPIPE, SIG_DFL);                  // ignored dispositions survive exec

  if (::dup2(in, STDIN_FILENO) < 0 || ::dup2(out, STDOUT_FILENO) < 0 ||
      ::dup2(err, STDERR_FILENO) < 0) {
    ::_exit(126);
  }
  if (inherit_fd >= 0 && ::fcntl(inherit_fd, F_SETFD, 0) != 0) ::_exit(126);
  ::execvpe(argv[0], argv, envp);

  const int error = errno;
  char message[512];
  int n = std::snprintf(message, sizeof message, "cohortrun: cannot exec '%s': %s\n", argv[0],
                        std::strerror(error));
  if (n > 0) {
    ssize_t ignored = ::write(STDERR_FILENO, message, std::min<size_t>(n, sizeof message - 1));
    (void)ignored;
  }
  ::_exit(error == ENOENT ? 127 : 126);
}

}  // namespace

RankProcess spawn_rank(const std::vector<std::string>& command, const std::vector<std::string>& env,
                       int inherit_fd) {
  // Everything the child needs is built before fork.
  std::vector<char*> argv = c_strings(command);
  std::vector<char*> envp = c_strings(env);
  UniqueFd devnull(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!devnull.valid()) fail("open /dev/null");
  Pipe out = make_pipe();
  Pipe err = make_pipe();
  const pid_t launcher = ::getpid();

  pid_t pid = ::fork();
  if (pid < 0) fail("fork");
  if (pid == 0) {
    exec_child(launcher, devnull.get(), out.write.get(), err.write.get(), inherit_fd, argv.data(),
               envp.data());
  }
  // Also set the group here, so it exists before the launcher might signal
  // it, whichever process runs first. EACCES: the child already exec'd,
  // after setting it itself.
  ::setpgid(pid, pid);

  RankProcess rank;
  rank.pid = pid;
  rank.out = std::move(out.read);
  rank.err = std::move(err.read);
  return rank;
}

}  // namespace cohortrun
