// defines: report_failure, report_timeout — what the launcher tells the user
// about a job that did not finish.
#pragma once

#include <string>
#include <vector>

#include "exit_status.h"
#include "rank_output.h"

namespace cohortrun {

// "rank 1 exited with code 3; last output:" and the rank's last lines.
void report_failure(int rank, const ExitStatus& status, const RankOutput& output);

struct RunningRank {
  int rank;
  const RankOutput* output;
};

// "job exceeded --timeout S s; ranks still running: [..]" and each of those
// ranks' last lines: where a rank stopped is the clue to why it hangs.
void report_timeout(const std::string& timeout_text, const std::vector<RunningRank>& running);

}  // namespace cohortrun
