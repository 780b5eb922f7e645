#include "job_token.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "cohort/core/error.h"
#include "fd.h"

namespace cohortrun {
namespace {

std::string folder_of(const std::string& path) { return path.substr(0, path.rfind('/')); }

// A folder (not a link) that only this user can enter or write.
bool private_folder(const std::string& dir) {
  struct stat st {};
  return ::lstat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == ::getuid() &&
         (st.st_mode & 077) == 0;
}

}  // namespace

std::string new_job_token() {
  std::ifstream random("/dev/urandom", std::ios::binary);
  unsigned char bytes[16] = {};
  random.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  std::string hex;
  char two[3];
  for (unsigned char b : bytes) {
    std::snprintf(two, sizeof two, "%02x", b);
    hex += two;
  }
  return random ? hex : std::string();
}

std::string token_file(const Options& options) {
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  const std::string dir = runtime != nullptr && *runtime != '\0' && private_folder(runtime)
                              ? std::string(runtime) + "/cohortrun"
                              : "/tmp/cohortrun-" + std::to_string(::getuid());
  return dir + "/rdzv-" + options.rdzv_id + "-" + std::to_string(options.master_port) + ".token";
}

void write_token_file(const std::string& path, const std::string& token) {
  const std::string dir = folder_of(path);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    throw cohort::Error("cannot create " + dir + ": " + std::strerror(errno));
  }
  if (!private_folder(dir)) {
    throw cohort::Error(dir +
                        " is not a folder of this user's alone (mode 0700): it cannot "
                        "hold the job's store token; remove it or set COHORT_STORE_TOKEN");
  }
  // Written beside and renamed over: a reader sees the old token or the new.
  const std::string part = path + "." + std::to_string(::getpid());
  ::unlink(part.c_str());
  UniqueFd fd(::open(part.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid() ||
      ::write(fd.get(), token.data(), token.size()) != static_cast<ssize_t>(token.size()) ||
      ::rename(part.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(part.c_str());
    throw cohort::Error("cannot write the job's store token to " + path + ": " + why);
  }
}

std::optional<std::string> read_token_file(const std::string& path) {
  if (!private_folder(folder_of(path))) return std::nullopt;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  struct stat st {};
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0 || st.st_uid != ::getuid() ||
      (st.st_mode & 077) != 0) {
    return std::nullopt;
  }
  char buf[64];
  const ssize_t k = ::read(fd.get(), buf, sizeof buf);
  if (k <= 0) return std::nullopt;
  return std::string(buf, static_cast<size_t>(k));
}

}  // namespace cohortrun
