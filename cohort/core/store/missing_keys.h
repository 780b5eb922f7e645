// defines: missing_keys_message, the one wording of a store wait's timeout.
#pragma once

#include <string>
#include <vector>

#include "cohort/core/types.h"

namespace cohort {

// "TcpStore wait timed out after 5000 ms; keys still missing: a, b"
std::string missing_keys_message(const std::string& store, const std::vector<std::string>& missing,
                                 Millis timeout);

}  // namespace cohort
