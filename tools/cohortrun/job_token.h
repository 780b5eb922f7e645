// defines: new_job_token (the store token cohortrun makes for a job) and the
// token file through which the launchers of one machine share theirs.
//
// A --nnodes MIN:MAX job whose --master-addr is a loopback address has all
// its launchers on this machine: the host makes a token and leaves it in a
// file only this user can read (the same user starts them all), and the
// others read it there. Launchers on other machines could not, so a job
// across machines is as protected as the COHORT_STORE_TOKEN its user sets.
#pragma once

#include <optional>
#include <string>

#include "options.h"

namespace cohortrun {

// 128 random bits as hex; empty when /dev/urandom cannot be read.
std::string new_job_token();

// Where the host of `options`' rendezvous leaves its token for the other
// launchers of this machine: $XDG_RUNTIME_DIR, else /tmp/cohortrun-<uid>,
// named after --rdzv-id and --master-port.
std::string token_file(const Options& options);

// Writes `token` to `path` (mode 0600, replacing an earlier job's file at
// once), creating its folder (0700). Throws cohort::Error when the folder is
// not this user's alone or the file cannot be written.
void write_token_file(const std::string& path, const std::string& token);

// The token in `path`, or nothing when there is none yet, or the file or
// its folder is not this user's alone (another user may have made it).
std::optional<std::string> read_token_file(const std::string& path);

}  // namespace cohortrun
