#include "cohort/dcp/checkpoint_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

namespace cohort {
namespace {

constexpr char kMagic[8] = {'C', 'O', 'H', 'O', 'R', 'T', 'C', 'K'};

uint32_t crc_of(const std::string& data) { return crc32_of(data.data(), data.size()); }

template <typename T>
void put_le(std::string& out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i)
    out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

template <typename T>
T get_le(const std::string& in, size_t at) {
  T value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<T>(static_cast<unsigned char>(in[at + i])) << (8 * i);
  }
  return value;
}

[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw Error("checkpoint " + path + ": " + what + " failed: " + std::strerror(errno));
}

std::string folder_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

uint32_t crc32_of(const void* data, size_t bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  // zlib takes uInt lengths: feed large buffers in pieces.
  size_t off = 0;
  while (off < bytes) {
    const size_t n = std::min<size_t>(bytes - off, 1u << 30);
    crc = crc32(crc, p + off, static_cast<uInt>(n));
    off += n;
  }
  return static_cast<uint32_t>(crc);
}

void write_file_atomically(const std::string& path,
                           const std::vector<std::pair<const void*, size_t>>& pieces) {
  // The pid and thread keep concurrent writers (a restarted job racing a
  // dying one, ranks as threads) off each other's temporary files.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                          std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id()));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_fail("open " + tmp, path);
  auto fail_closed = [&](const std::string& what) {
    const int saved = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    errno = saved;
    io_fail(what + " " + tmp, path);
  };
  for (const auto& [data, bytes] : pieces) {
    const auto* p = static_cast<const char*>(data);
    size_t off = 0;
    while (off < bytes) {
      const ssize_t n = ::write(fd, p + off, bytes - off);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail_closed("write");
      off += static_cast<size_t>(n);
    }
  }
  if (::fsync(fd) != 0) fail_closed("fsync");
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    io_fail("close " + tmp, path);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    io_fail("rename " + tmp, path);
  }
  // The rename is durable only once the folder's entry is on disk.
  const std::string dir = folder_of(path);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) io_fail("open folder " + dir, path);
  const int rc = ::fsync(dfd);
  ::close(dfd);
  if (rc != 0) io_fail("fsync folder " + dir, path);
}

void write_checkpoint_file(const std::string& path, const std::string& payload) {
  std::string header;
  header.append(kMagic, sizeof(kMagic));
  put_le<uint32_t>(header, kCheckpointVersion);
  put_le<uint32_t>(header, crc_of(payload));
  put_le<uint64_t>(header, payload.size());
  write_file_atomically(path, {{header.data(), header.size()}, {payload.data(), payload.size()}});
}

std::string read_checkpoint_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError("checkpoint " + path + ": cannot open: " + std::strerror(errno));
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string data = buffer.str();
  auto fail = [&](const std::string& what) {
    throw CheckpointError("checkpoint " + path + ": " + what);
  };
  if (data.size() < kCheckpointHeaderBytes) {
    fail("truncated: " + std::to_string(data.size()) + " bytes, shorter than the " +
         std::to_string(kCheckpointHeaderBytes) + "-byte header");
  }
  if (std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) {
    fail("not a cohort checkpoint (bad magic)");
  }
  const auto version = get_le<uint32_t>(data, 8);
  if (version != kCheckpointVersion) {
    fail("format version " + std::to_string(version) + ", this build reads version " +
         std::to_string(kCheckpointVersion));
  }
  const auto stored_crc = get_le<uint32_t>(data, 12);
  const auto length = get_le<uint64_t>(data, 16);
  const uint64_t have = data.size() - kCheckpointHeaderBytes;
  if (have != length) {
    fail(std::string(have < length ? "truncated" : "trailing bytes") + ": header says " +
         std::to_string(length) + " payload bytes, file has " + std::to_string(have));
  }
  std::string payload = data.substr(kCheckpointHeaderBytes);
  const auto crc = crc_of(payload);
  if (crc != stored_crc) {
    char text[96];
    std::snprintf(text, sizeof(text), "checksum mismatch: stored crc32 %08x, payload has %08x",
                  stored_crc, crc);
    fail(text);
  }
  return payload;
}

}  // namespace cohort
