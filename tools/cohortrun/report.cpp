#include "report.h"

#include <unistd.h>

#include <string>

#include "output.h"

namespace cohortrun {
namespace {

void print_tail(int rank, const RankOutput& output) {
  const std::string name = "rank " + std::to_string(rank);
  if (output.tail().empty()) {
    log_line(name + " wrote no output");
    return;
  }
  std::string text = "cohortrun: last output of " + name + ":\n";
  for (const std::string& line : output.tail()) text += line + "\n";
  write_all(STDERR_FILENO, text);
}

}  // namespace

void report_failure(int rank, const ExitStatus& status, const RankOutput& output) {
  std::string what = "rank " + std::to_string(rank) + " " + status.describe();
  log_line(what);
  print_tail(rank, output);
}

void report_timeout(const std::string& timeout_text, const std::vector<RunningRank>& running) {
  std::string list;
  for (const RunningRank& r : running) {
    if (!list.empty()) list += ", ";
    list += std::to_string(r.rank);
  }
  log_line("job exceeded --timeout " + timeout_text + " s; ranks still running: [" + list + "]");
  for (const RunningRank& r : running) {
    print_tail(r.rank, *r.output);
  }
}

}  // namespace cohortrun
