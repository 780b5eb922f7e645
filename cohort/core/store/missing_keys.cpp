#include "cohort/core/store/missing_keys.h"

namespace cohort {

std::string missing_keys_message(const std::string& store, const std::vector<std::string>& missing,
                                 Millis timeout) {
  std::string msg = store + " wait timed out after " + std::to_string(timeout.count()) +
                    " ms; keys still missing:";
  const size_t shown = std::min<size_t>(missing.size(), 8);
  for (size_t i = 0; i < shown; ++i) msg += (i ? ", " : " ") + missing[i];
  if (missing.size() > shown) {
    msg += " (and " + std::to_string(missing.size() - shown) + " more)";
  }
  return msg;
}

}  // namespace cohort
