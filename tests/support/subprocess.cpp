#include "support/subprocess.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

extern char** environ;

namespace cohort::testing {
namespace {

std::runtime_error os_error(const std::string& what) {
  return std::runtime_error(what + ": " + std::strerror(errno));
}

std::string key_of(const std::string& entry) { return entry.substr(0, entry.find('=')); }

std::vector<std::string> merged_environment(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    bool overridden = std::any_of(extra.begin(), extra.end(),
                                  [&](const std::string& x) { return key_of(x) == key_of(entry); });
    if (!overridden) env.push_back(entry);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (const std::string& s : strings) {
    out.push_back(const_cast<char*>(s.c_str()));
  }
  out.push_back(nullptr);
  return out;
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

Subprocess::Subprocess(const std::vector<std::string>& argv,
                       const std::vector<std::string>& extra_env) {
  std::vector<std::string> env = merged_environment(extra_env);
  std::vector<char*> c_argv = c_strings(argv);
  std::vector<char*> c_env = c_strings(env);
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    throw os_error("pipe2");
  }
  start_ = Clock::now();
  pid_ = ::fork();
  if (pid_ < 0) throw os_error("fork");
  if (pid_ == 0) {
    int devnull = ::open("/dev/null", O_RDONLY);
    ::dup2(devnull, STDIN_FILENO);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::execve(c_argv[0], c_argv.data(), c_env.data());
    std::fprintf(stderr, "exec %s: %s\n", c_argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  out_fd_ = out[0];
  err_fd_ = err[0];
  pid_fd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
}

Subprocess::~Subprocess() {
  if (!exited_) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  for (int fd : {out_fd_, err_fd_, pid_fd_}) {
    if (fd >= 0) ::close(fd);
  }
}

void Subprocess::try_reap() {
  if (exited_) return;
  if (::waitpid(pid_, &status_, WNOHANG) == pid_) {
    exited_ = true;
    end_ = Clock::now();
  }
}

void Subprocess::pump(Clock::time_point deadline) {
  std::vector<pollfd> fds;
  for (int fd : {out_fd_, err_fd_}) {
    if (fd >= 0) fds.push_back({fd, POLLIN, 0});
  }
  if (!exited_ && pid_fd_ >= 0) fds.push_back({pid_fd_, POLLIN, 0});
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  int timeout = static_cast<int>(std::max<long>(0, left.count()) + 1);
  // Without a pidfd (old kernels), exit is noticed by checking often.
  if (pid_fd_ < 0 && !exited_) timeout = std::min(timeout, 10);
  if (::poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR) {
    throw os_error("poll");
  }
  for (const pollfd& p : fds) {
    if (p.revents == 0 || p.fd == pid_fd_) continue;
    char buf[65536];
    ssize_t n = ::read(p.fd, buf, sizeof buf);
    if (n > 0) {
      (p.fd == out_fd_ ? out_ : err_).append(buf, n);
    } else if (n == 0 || errno != EINTR) {
      ::close(p.fd);
      (p.fd == out_fd_ ? out_fd_ : err_fd_) = -1;
    }
  }
  try_reap();
}

bool Subprocess::wait_for_stdout(const std::string& needle, int count, Seconds limit) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(limit);
  while (count_of(out_, needle) < count) {
    if (Clock::now() >= deadline || (exited_ && out_fd_ < 0)) return false;
    pump(deadline);
  }
  return true;
}

ProcessResult Subprocess::finish(Seconds limit) {
  const Clock::time_point deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(limit);
  ProcessResult result;
  while (!exited_ || out_fd_ >= 0 || err_fd_ >= 0) {
    if (Clock::now() >= deadline) {
      result.timed_out = true;
      ::kill(pid_, SIGKILL);
      if (!exited_) {
        ::waitpid(pid_, &status_, 0);
        exited_ = true;
        end_ = Clock::now();
      }
      break;
    }
    pump(deadline);
  }
  result.exit_code = exit_code_of(status_);
  result.out = out_;
  result.err = err_;
  result.seconds = Seconds(end_ - start_).count();
  return result;
}

ProcessResult run_process(const std::vector<std::string>& argv, Seconds limit,
                          const std::vector<std::string>& extra_env) {
  Subprocess p(argv, extra_env);
  return p.finish(limit);
}

std::vector<std::string> cohortrun_argv(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {COHORTRUN_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

ProcessResult run_cohortrun(const std::vector<std::string>& args, Seconds limit,
                            const std::vector<std::string>& extra_env) {
  return run_process(cohortrun_argv(args), limit, extra_env);
}

TempDir::TempDir(const std::string& prefix) {
  std::string templ = "/tmp/" + prefix + "-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw os_error("mkdtemp");
  path_ = templ;
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::vector<pid_t> read_pids(const std::string& dir) {
  std::vector<pid_t> pids;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(entry.path());
    pid_t pid;
    while (in >> pid) pids.push_back(pid);
  }
  return pids;
}

namespace {

char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return 0;
  size_t close = stat.rfind(')');
  return close + 2 < stat.size() ? stat[close + 2] : 0;
}

}  // namespace

bool process_exists(pid_t pid) { return process_state(pid) != 0; }

bool process_running(pid_t pid) {
  char state = process_state(pid);
  return state != 0 && state != 'Z';
}

void write_file(const std::string& path, const std::string& text, bool executable) {
  std::ofstream(path) << text;
  if (executable) ::chmod(path.c_str(), 0755);
}

int count_of(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + needle.size())) {
    ++n;
  }
  return n;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

int free_port_pair() {
  for (int attempt = 0; attempt < 20; ++attempt) {
    int ports[2] = {0, 0};
    int fds[2] = {-1, -1};
    for (int i = 0; i < 2; ++i) {
      fds[i] = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(i == 0 ? 0 : ports[0] + 1));
      socklen_t len = sizeof addr;
      if (::bind(fds[i], reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
          ::getsockname(fds[i], reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
        ports[i] = ntohs(addr.sin_port);
      }
    }
    for (int fd : fds) ::close(fd);
    if (ports[0] > 0 && ports[0] < 65535 && ports[1] == ports[0] + 1) return ports[0];
  }
  return 0;
}

}  // namespace cohort::testing
