// defines: reading the launcher's environment with clear errors.
#pragma once

#include <optional>
#include <string>

#include "cohort/core/types.h"

namespace cohort::env {

std::optional<std::string> get(const char* name);
// Throws ConfigError naming the variable when it is unset or not an integer
// in [lo, hi].
int require_int(const char* name, int lo, int hi);
std::optional<int> get_int(const char* name, int lo, int hi);
// COHORT_TIMEOUT: seconds, fractions allowed.
std::optional<Millis> timeout(const char* name);

}  // namespace cohort::env
