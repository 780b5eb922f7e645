#include "cohort/dcp/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cohort/core/dtypes.h"
#include "cohort/dcp/checkpoint_file.h"

// The data is written and read as the host's bytes; the format is little
// endian, as is every host cohort builds on.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little endian");

namespace cohort::dcp {
namespace {

// Ordered: a header's tensors keep their order, written and read.
using json = nlohmann::ordered_json;

// A header longer than this is refused before it is allocated (the Rust
// reader's limit is 100 MB too).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Tensor bytes past this would overflow the offset arithmetic.
constexpr int64_t kMaxTensorBytes = int64_t{1} << 62;

CheckpointError file_error(const std::string& file, const std::string& what) {
  return CheckpointError("safetensors " + file + ": " + what);
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void pread_all(int fd, char* out, int64_t bytes, int64_t at, const std::string& file) {
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n =
        ::pread(fd, out + done, static_cast<size_t>(bytes - done), static_cast<off_t>(at + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw file_error(file,
                       n == 0 ? "truncated" : std::string("read failed: ") + std::strerror(errno));
    }
    done += n;
  }
}

// The bytes of a tensor of `shape` and element size `element`, or -1 when
// a dimension is negative or they would pass kMaxTensorBytes.
int64_t tensor_bytes(const std::vector<int64_t>& shape, int64_t element) {
  int64_t bytes = element;
  for (auto d : shape) {
    if (d < 0) return -1;
    if (d != 0 && bytes > kMaxTensorBytes / d) return -1;
    bytes *= d;
  }
  return bytes;
}

std::string shard_name(const std::string& stem, size_t k, size_t n) {
  char buf[64];  // room for two 20-digit counts
  std::snprintf(buf, sizeof(buf), "-%05zu-of-%05zu", k + 1, n);
  return stem + buf + ".safetensors";
}

// Writes one file: the header, padded with spaces to 8 bytes as the Python
// writer does, then each tensor's bytes.
void write_one(const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
               const std::string& path, const SafetensorsOptions& options) {
  json header = json::object();
  if (!options.metadata.empty()) header["__metadata__"] = options.metadata;
  int64_t at = 0;
  for (const auto& [name, t] : tensors) {
    const auto end = at + static_cast<int64_t>(t.nbytes());
    header[name] = {{"dtype", safetensors_dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {at, end}}};
    at = end;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  std::vector<std::pair<const void*, size_t>> pieces = {{&n, 8}, {text.data(), text.size()}};
  for (const auto& [name, t] : tensors) pieces.emplace_back(t.data_ptr(), t.nbytes());
  write_file_atomically(path, pieces);
}

// One tensor's header entry `v` in `file`, whose data section holds `data`
// bytes, checked: the entry (its offset within the data section) and its
// byte range there.
std::pair<SafetensorsEntry, std::pair<int64_t, int64_t>> parse_entry(const std::string& file,
                                                                     const std::string& name,
                                                                     const json& v, int64_t data) {
  const auto where = "tensor " + name + ": ";
  if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
      !v.contains("data_offsets") || !v["dtype"].is_string() || !v["shape"].is_array() ||
      !v["data_offsets"].is_array() || v["data_offsets"].size() != 2) {
    throw file_error(file, where + "needs \"dtype\", \"shape\" and two \"data_offsets\"");
  }
  const auto dtype = v["dtype"].get<std::string>();
  const DtypeInfo* info = find_dtype(&DtypeInfo::safetensors, dtype);
  if (!info) throw file_error(file, where + "unsupported dtype \"" + dtype + "\"");
  std::vector<int64_t> shape;
  for (const auto& d : v["shape"]) {
    if (!d.is_number_integer()) throw file_error(file, where + "a dimension is not an integer");
    shape.push_back(
        d.is_number_unsigned() && d.get<uint64_t>() > uint64_t{INT64_MAX} ? -1 : d.get<int64_t>());
  }
  const int64_t bytes = tensor_bytes(shape, static_cast<int64_t>(c10::elementSize(info->dtype)));
  if (bytes < 0)
    throw file_error(file, where + "the shape " + shape_string(shape) + " is impossible");
  int64_t off[2];
  for (int i = 0; i < 2; ++i) {
    const auto& o = v["data_offsets"][i];
    if (!o.is_number_unsigned() || o.get<uint64_t>() > static_cast<uint64_t>(data)) {
      throw file_error(file, where + "data_offsets " + v["data_offsets"].dump() +
                                 " pass the data's " + std::to_string(data) + " bytes");
    }
    off[i] = o.get<int64_t>();
  }
  if (off[1] - off[0] != bytes) {
    throw file_error(file, where + "data_offsets " + v["data_offsets"].dump() + " hold " +
                               std::to_string(off[1] - off[0]) + " bytes; " + dtype + " " +
                               shape_string(shape) + " needs " + std::to_string(bytes));
  }
  return {{name, info->dtype, shape, file, off[0]}, {off[0], off[1]}};
}

// Whether `name` is a shard of `stem` as shard_name writes it.
bool is_shard_of(const std::string& name, const std::string& stem) {
  const std::string suffix = ".safetensors";
  if (name.size() <= stem.size() + 1 + suffix.size() || name.compare(0, stem.size(), stem) != 0 ||
      name[stem.size()] != '-' ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  const auto counts = name.substr(stem.size() + 1, name.size() - stem.size() - 1 - suffix.size());
  const auto of = counts.find("-of-");
  auto digits = [](const std::string& t) {
    return !t.empty() && t.find_first_not_of("0123456789") == std::string::npos;
  };
  return of != std::string::npos && digits(counts.substr(0, of)) && digits(counts.substr(of + 4));
}

// Removes what an earlier save under `path` left that this one does not
// replace: its index and shards, and, when this save is sharded
// (`sharded`), its single file. Left there, a reader that looks for the
// single file first (transformers) or is given `path` would take the old
// weights, and an old index would name new shards among old ones. Done
// before anything is written, so that a crash leaves no save that looks
// whole rather than a mixture.
void remove_earlier_save(const std::string& path, const std::string& stem, bool sharded) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  const fs::path folder = p.has_parent_path() ? p.parent_path() : fs::path(".");
  auto remove = [](const fs::path& file) {
    std::error_code ec;
    if (!fs::remove(file, ec) && ec) {
      throw CheckpointError("safetensors " + file.string() +
                            ": cannot remove this file of an earlier save: " + ec.message());
    }
  };
  remove(path + ".index.json");
  if (sharded) remove(p);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    if (is_shard_of(entry.path().filename().string(), stem)) remove(entry.path());
  }
}

}  // namespace

std::string safetensors_dtype_name(torch::Dtype dtype) {
  if (const DtypeInfo* d = find_dtype(dtype)) return d->safetensors;
  throw Unsupported(std::string("safetensors: dtype ") + c10::toString(dtype) +
                    " is not supported");
}

std::vector<std::string> save_safetensors(const NamedTensors& tensors, const std::string& path,
                                          const SafetensorsOptions& options) {
  // Contiguous CPU copies, kept alive while written.
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& item : tensors) {
    auto t = item.value().detach().to(torch::kCPU).contiguous();
    safetensors_dtype_name(t.scalar_type());  // refuses before anything is written
    const auto bytes = static_cast<int64_t>(t.nbytes());
    if (options.max_shard_bytes > 0 && !shards.back().empty() &&
        in_shard + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().emplace_back(item.key(), t);
    in_shard += bytes;
    total += bytes;
  }
  namespace fs = std::filesystem;
  const fs::path p(path);
  auto stem = p.filename().string();
  if (auto dot = stem.rfind(".safetensors"); dot != std::string::npos) stem.resize(dot);
  remove_earlier_save(path, stem, shards.size() > 1);
  if (shards.size() == 1) {
    write_one(shards[0], path, options);
    return {path};
  }
  std::vector<std::string> written;
  json weight_map = json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    const auto name = shard_name(stem, k, shards.size());
    write_one(shards[k], (p.parent_path() / name).string(), options);
    written.push_back((p.parent_path() / name).string());
    for (const auto& [tensor, t] : shards[k]) weight_map[tensor] = name;
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const auto text = index.dump(2) + "\n";
  written.push_back(path + ".index.json");
  write_file_atomically(written.back(), {{text.data(), text.size()}});
  return written;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  if (path.size() < 5 || path.compare(path.size() - 5, 5, ".json") != 0) {
    read_header(path);
    return;
  }
  std::ifstream in(path);
  if (!in) throw file_error(path, "cannot open: " + std::string(std::strerror(errno)));
  json index;
  try {
    index = json::parse(in);
  } catch (const json::exception& e) {
    throw file_error(path, std::string("the index is not JSON: ") + e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    throw file_error(path, "the index has no \"weight_map\" object");
  }
  // Each shard once, in the order the weight map first names it.
  std::vector<std::string> shards;
  std::map<std::string, std::string> wants;
  const auto folder = std::filesystem::path(path).parent_path();
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) throw file_error(path, "tensor " + name + ": its file is not a string");
    const auto shard = (folder / file.get<std::string>()).string();
    if (std::find(shards.begin(), shards.end(), shard) == shards.end()) shards.push_back(shard);
    wants[name] = shard;
  }
  for (const auto& shard : shards) read_header(shard);
  for (const auto& [name, shard] : wants) {
    const auto* e = find(name);
    if (!e || e->file != shard) throw file_error(path, "tensor " + name + " is not in " + shard);
  }
  if (entries_.size() != wants.size()) {
    for (const auto& e : entries_) {
      if (!wants.count(e.name))
        throw file_error(e.file, "tensor " + e.name + " is not in the index");
    }
  }
}

void SafetensorsFile::read_header(const std::string& file) {
  Fd f;
  f.fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw file_error(file, "cannot open: " + std::string(std::strerror(errno)));
  struct stat st = {};
  if (::fstat(f.fd, &st) != 0)
    throw file_error(file, "fstat failed: " + std::string(strerror(errno)));
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < 8)
    throw file_error(file, "truncated: " + std::to_string(size) + " bytes, no header length");
  uint64_t n = 0;
  pread_all(f.fd, reinterpret_cast<char*>(&n), 8, 0, file);
  if (n > kMaxHeaderBytes || n > size - 8) {
    throw file_error(file, "the header length " + std::to_string(n) + " passes the file's " +
                               std::to_string(size) + " bytes or the limit of " +
                               std::to_string(kMaxHeaderBytes));
  }
  std::string text(n, '\0');
  pread_all(f.fd, text.data(), static_cast<int64_t>(n), 8, file);
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    throw file_error(file, std::string("the header is not JSON: ") + e.what());
  }
  if (!header.is_object()) throw file_error(file, "the header is not a JSON object");
  const int64_t data = static_cast<int64_t>(size - 8 - n);
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::string>> spans;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw file_error(file, "\"__metadata__\" is not an object");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string())
          throw file_error(file, "\"__metadata__\" entry " + k + " is not a string");
        metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    const auto where = "tensor " + name + ": ";
    const auto [entry, span] = parse_entry(file, name, v, data);
    if (find(name)) throw file_error(file, where + "named twice");
    spans.push_back({span, name});
    index_[name] = entries_.size();
    entries_.push_back(entry);
    entries_.back().offset += static_cast<int64_t>(8 + n);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first.first < spans[i - 1].first.second) {
      throw file_error(file, "tensors " + spans[i - 1].second + " and " + spans[i].second +
                                 " overlap in the data");
    }
  }
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

torch::Tensor SafetensorsFile::read(const std::string& name) const {
  const auto* e = find(name);
  if (!e) throw file_error(path_, "no tensor " + name);
  return read_box(name, whole(e->shape));
}

torch::Tensor SafetensorsFile::read_box(const std::string& name, const Box& box) const {
  const auto* e = find(name);
  if (!e) throw file_error(path_, "no tensor " + name);
  const auto dims = e->shape.size();
  bool inside = box.offsets.size() == dims && box.lengths.size() == dims;
  for (size_t d = 0; inside && d < dims; ++d) {
    inside = box.offsets[d] >= 0 && box.lengths[d] >= 0 &&
             box.offsets[d] + box.lengths[d] <= e->shape[d];
  }
  if (!inside) {
    throw file_error(e->file, "tensor " + name + ": the box " + to_string(box) + " is not inside " +
                                  shape_string(e->shape));
  }
  auto out = torch::empty(box.lengths, torch::TensorOptions().dtype(e->dtype));
  if (out.numel() == 0) return out;
  // Dims [j, end) of the box are one contiguous run of the stored tensor:
  // every dim after j is whole.
  size_t j = dims;
  while (j > 0 && (j == dims || box.lengths[j] == e->shape[j])) --j;
  const int64_t element = static_cast<int64_t>(c10::elementSize(e->dtype));
  std::vector<int64_t> stride(dims + 1, element);
  for (size_t d = dims; d-- > 0;) stride[d] = stride[d + 1] * e->shape[d];
  const int64_t run = dims == 0 ? element : box.lengths[j] * stride[j + 1];
  Fd f;
  f.fd = ::open(e->file.c_str(), O_RDONLY | O_CLOEXEC);
  if (f.fd < 0) throw file_error(e->file, "cannot open: " + std::string(std::strerror(errno)));
  auto* dst = static_cast<char*>(out.data_ptr());
  std::vector<int64_t> at(j, 0);  // the index within the box of the dims before j
  for (int64_t written = 0; written < static_cast<int64_t>(out.nbytes()); written += run) {
    int64_t pos = e->offset;
    for (size_t d = 0; d < j; ++d) pos += (box.offsets[d] + at[d]) * stride[d + 1];
    if (dims > 0) pos += box.offsets[j] * stride[j + 1];
    pread_all(f.fd, dst + written, run, pos, e->file);
    for (size_t d = j; d-- > 0;) {
      if (++at[d] < box.lengths[d]) break;
      at[d] = 0;
    }
  }
  return out;
}

NamedTensors load_safetensors(const std::string& path) {
  const SafetensorsFile file(path);
  NamedTensors out;
  for (const auto& e : file.entries()) out.insert(e.name, file.read(e.name));
  return out;
}

}  // namespace cohort::dcp
