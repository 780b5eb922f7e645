#include "idx_file.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "cohort/core/error.h"

namespace fashion_mnist {
namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw cohort::InvalidArgument("fashion_mnist: " + path + ": " + what);
}

void read_exact(gzFile f, void* out, size_t n, const std::string& path, const char* what) {
  size_t done = 0;
  while (done < n) {
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
    const int got = gzread(f, static_cast<char*>(out) + done, chunk);
    if (got < 0) {
      int err = 0;
      fail(path, std::string("gzip read error while reading the ") + what + ": " + gzerror(f, &err));
    }
    if (got == 0) {
      fail(path, std::string("file ends early while reading the ") + what + " (" +
                     std::to_string(done) + " of " + std::to_string(n) + " bytes)");
    }
    done += static_cast<size_t>(got);
  }
}

uint32_t big_endian(const unsigned char* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
}

}  // namespace

torch::Tensor read_idx_gz(const std::string& path) {
  if (!std::filesystem::exists(path)) fail(path, "no such file");
  std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), gzclose);
  if (!file) fail(path, std::string("cannot open: ") + std::strerror(errno));
  unsigned char magic[4];
  read_exact(file.get(), magic, 4, path, "header");
  // Bytes 0-1 are zero, byte 2 is the type (0x08: unsigned byte), byte 3 the rank.
  if (magic[0] != 0 || magic[1] != 0) fail(path, "not an IDX file (bad magic)");
  if (magic[2] != 0x08) fail(path, "element type " + std::to_string(magic[2]) + ", expected 8 (ubyte)");
  const int rank = magic[3];
  if (rank < 1 || rank > 4) fail(path, "implausible rank " + std::to_string(rank));
  std::vector<int64_t> dims;
  int64_t count = 1;
  for (int i = 0; i < rank; ++i) {
    unsigned char b[4];
    read_exact(file.get(), b, 4, path, "dimensions");
    dims.push_back(big_endian(b));
    count *= dims.back();
  }
  auto out = torch::empty(dims, torch::kUInt8);
  read_exact(file.get(), out.data_ptr<uint8_t>(), static_cast<size_t>(count), path, "data");
  return out;
}

}  // namespace fashion_mnist
