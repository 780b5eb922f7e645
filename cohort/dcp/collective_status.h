// defines: agree and gather_strings, the two small collectives that make a
// checkpoint error one rank met an error on every rank.
#pragma once

#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort::dcp {

/// Collective: every rank passes its error ("" when none). Throws
/// CheckpointError on every rank with the lowest failing rank's message
/// ("rank r: ...") when any rank failed.
void agree(Communicator& comm, const std::string& error);

/// Collective: rank `root` gets every rank's string, in rank order; the
/// others get an empty vector.
std::vector<std::string> gather_strings(Communicator& comm, const std::string& mine, int root);

}  // namespace cohort::dcp
