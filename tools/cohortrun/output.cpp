#include "output.h"

#include <unistd.h>

#include <cerrno>
#include <string>

namespace cohortrun {

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
}

void log_line(std::string_view message) {
  std::string line = "cohortrun: ";
  line.append(message);
  line.push_back('\n');
  write_all(STDERR_FILENO, line);
}

}  // namespace cohortrun
