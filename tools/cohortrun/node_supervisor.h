// defines: supervise_nodes — the launcher's loop for --nnodes MIN:MAX: join a
// generation, run this node's ranks in it, and after it ends join the next,
// until the ranks succeed or the restart budget is spent.
#pragma once

#include "options.h"

namespace cohortrun {

// Returns the launcher's exit code (0 when this node's ranks succeeded).
int supervise_nodes(const Options& options);

}  // namespace cohortrun
