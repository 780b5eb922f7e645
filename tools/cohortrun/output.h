// defines: write_all, log_line — the launcher's only ways of writing output.
#pragma once

#include <string_view>

namespace cohortrun {

// Writes all of `data` with as few write() calls as the fd allows. Each
// prefixed line goes out through one call, so lines from different ranks
// never interleave. Errors (a closed reader: EPIPE) drop the output: losing
// a log line must not take the job down.
void write_all(int fd, std::string_view data);

// "cohortrun: <message>\n" on stderr.
void log_line(std::string_view message);

}  // namespace cohortrun
