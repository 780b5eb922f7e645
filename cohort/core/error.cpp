#include "cohort/core/error.h"

namespace cohort::detail {

void check_failed(const char* file, int line, const char* cond, const std::string& message) {
  std::ostringstream os;
  os << "cohort internal error at " << file << ":" << line << ": check `" << cond << "` failed";
  if (!message.empty()) os << ": " << message;
  throw Error(os.str());
}

}  // namespace cohort::detail
