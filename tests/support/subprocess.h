// defines: Subprocess (a child process with captured output and bounded
// waits), run_process, and the process and file helpers the launcher tests
// share.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <string>
#include <vector>

namespace cohort::testing {

using Clock = std::chrono::steady_clock;
using Seconds = std::chrono::duration<double>;

struct ProcessResult {
  int exit_code = -1;      // 128 + signal when killed, as a shell reports
  bool timed_out = false;  // killed by us after the wait's limit
  std::string out;
  std::string err;
  double seconds = 0;  // from start to exit
};

// Every wait has a limit: past it the child is SIGKILLed and the result
// says timed_out, so a broken launcher fails a test instead of hanging it.
class Subprocess {
 public:
  // argv[0] is a path; extra_env entries ("K=V") override the inherited
  // environment.
  explicit Subprocess(const std::vector<std::string>& argv,
                      const std::vector<std::string>& extra_env = {});
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;
  ~Subprocess();  // SIGKILLs and reaps a child still running

  pid_t pid() const { return pid_; }
  // Reads output until stdout holds `count` occurrences of `needle`.
  bool wait_for_stdout(const std::string& needle, int count, Seconds limit);
  // The stdout read so far (by wait_for_stdout).
  const std::string& out_so_far() const { return out_; }
  // Reads all output and waits for exit.
  ProcessResult finish(Seconds limit);

 private:
  // One round of waiting for output or exit, until `deadline` at most.
  void pump(Clock::time_point deadline);
  void try_reap();

  pid_t pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  int pid_fd_ = -1;  // becomes readable when the child exits
  bool exited_ = false;
  int status_ = 0;
  Clock::time_point start_;
  Clock::time_point end_;
  std::string out_;
  std::string err_;
};

ProcessResult run_process(const std::vector<std::string>& argv, Seconds limit,
                          const std::vector<std::string>& extra_env = {});

// `cohortrun args...`, the binary under test.
ProcessResult run_cohortrun(const std::vector<std::string>& args, Seconds limit = Seconds(20),
                            const std::vector<std::string>& extra_env = {});
std::vector<std::string> cohortrun_argv(const std::vector<std::string>& args);

// A fresh directory under /tmp (named after `prefix`), removed with its
// contents on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "cohort-test");
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();
  const std::string& path() const { return path_; }
  const std::string& str() const { return path_; }
  // The path of `leaf` inside it.
  std::string operator/(const std::string& leaf) const { return path_ + "/" + leaf; }

 private:
  std::string path_;
};

// Pids written one per line into files of `dir` (ranks record $$ and $!).
std::vector<pid_t> read_pids(const std::string& dir);
// Whether the pid exists at all (a zombie counts: it was not reaped).
bool process_exists(pid_t pid);
// Whether the pid exists and is not a zombie.
bool process_running(pid_t pid);
void write_file(const std::string& path, const std::string& text, bool executable = false);
// A port free on 127.0.0.1 now (the kernel's pick) whose next port is free
// too; 0 when none was found.
int free_port_pair();
int count_of(const std::string& haystack, const std::string& needle);
std::vector<std::string> lines_of(const std::string& text);

}  // namespace cohort::testing
