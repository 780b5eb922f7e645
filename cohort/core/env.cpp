#include "cohort/core/env.h"

#include <cstdlib>

#include "cohort/core/error.h"

namespace cohort::env {

std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

std::optional<int> get_int(const char* name, int lo, int hi) {
  auto v = get(name);
  if (!v) return std::nullopt;
  size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v->size()) {
    throw ConfigError(std::string("cohort: environment variable ") + name + "='" + *v +
                      "' is not an integer");
  }
  if (x < lo || x > hi) {
    throw ConfigError(std::string("cohort: environment variable ") + name + "=" + *v +
                      " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return static_cast<int>(x);
}

int require_int(const char* name, int lo, int hi) {
  auto v = get_int(name, lo, hi);
  if (!v) {
    throw ConfigError(std::string("cohort: environment variable ") + name +
                      " is not set; start the job with cohortrun (or torchrun), or pass "
                      "it in InitOptions");
  }
  return *v;
}

std::optional<Millis> timeout(const char* name) {
  auto v = get(name);
  if (!v) return std::nullopt;
  size_t used = 0;
  double seconds = -1;
  try {
    seconds = std::stod(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v->size() || !(seconds > 0)) {
    throw ConfigError(std::string("cohort: environment variable ") + name + "='" + *v +
                      "' is not a positive number of seconds");
  }
  return Millis(static_cast<int64_t>(seconds * 1000));
}

}  // namespace cohort::env
