#include "cohort/dcp/metadata.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "cohort/core/dtypes.h"
#include "cohort/core/error.h"
#include "cohort/dcp/checkpoint_file.h"

namespace cohort::dcp {
namespace {

int64_t product(const std::vector<int64_t>& v, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < v.size(); ++i) n *= v[i];
  return n;
}

// boxes_of_range on the dims of `shape` from `dim` on, below the fixed
// indices `prefix` of the dims before it.
void cut(const std::vector<int64_t>& shape, size_t dim, std::vector<int64_t>& prefix, int64_t begin,
         int64_t end, std::vector<Box>& out) {
  if (begin >= end) return;
  auto box_of = [&](int64_t row0, int64_t rows) {
    Box b;
    b.offsets = prefix;
    b.lengths.assign(prefix.size(), 1);
    if (dim < shape.size()) {
      b.offsets.push_back(row0);
      b.lengths.push_back(rows);
      for (size_t d = dim + 1; d < shape.size(); ++d) {
        b.offsets.push_back(0);
        b.lengths.push_back(shape[d]);
      }
    }
    out.push_back(std::move(b));
  };
  if (dim == shape.size()) return box_of(0, 0);  // a 0-d tensor's one element
  const int64_t inner = product(shape, dim + 1);
  if (inner == 0) return;
  if (begin % inner == 0 && end % inner == 0) return box_of(begin / inner, (end - begin) / inner);
  const int64_t first = begin / inner, last = (end - 1) / inner;
  auto one_row = [&](int64_t row, int64_t b, int64_t e) {
    prefix.push_back(row);
    cut(shape, dim + 1, prefix, b, e, out);
    prefix.pop_back();
  };
  if (first == last) return one_row(first, begin - first * inner, end - first * inner);
  int64_t mid_begin = begin;
  if (begin % inner != 0) {
    one_row(first, begin % inner, inner);
    mid_begin = (first + 1) * inner;
  }
  const int64_t mid_end = end / inner * inner;
  if (mid_end > mid_begin) box_of(mid_begin / inner, (mid_end - mid_begin) / inner);
  if (end % inner != 0) one_row(end / inner, 0, end % inner);
}

[[noreturn]] void bad(const std::string& source, const std::string& what) {
  throw CheckpointError("checkpoint " + source + ": " + what);
}

// Extents a tensor can have: none negative, its bytes within int64 (so that
// every box and byte count below is exact).
void check_shape(const TensorMeta& t, const std::string& source) {
  int64_t bytes = static_cast<int64_t>(c10::elementSize(t.dtype));
  for (int64_t n : t.shape) {
    if (n < 0) {
      bad(source, "tensor " + t.fqn + ": negative extent in its shape " + shape_string(t.shape));
    }
    if (__builtin_mul_overflow(bytes, n, &bytes)) {
      bad(source, "tensor " + t.fqn + ": its shape " + shape_string(t.shape) +
                      " has more bytes than any file can hold");
    }
  }
}

// Each chunk's bytes inside its file, and the chunks tiling the tensor.
void check_chunks(const TensorMeta& t, const std::vector<FileMeta>& files,
                  const std::string& source) {
  const std::string tiling = tiling_error(t);
  if (!tiling.empty()) bad(source, "tensor " + t.fqn + ": " + tiling);
  const auto element = static_cast<int64_t>(c10::elementSize(t.dtype));
  for (const auto& c : t.chunks) {
    const int64_t bytes = c.box.numel() * element;  // inside the tensor: no overflow
    const auto& f = files[static_cast<size_t>(c.file)];
    if (c.byte_offset < 0 || c.byte_offset > f.bytes - bytes) {
      bad(source, "tensor " + t.fqn + ": the chunk " + to_string(c.box) + " (" +
                      std::to_string(bytes) + " bytes at " + std::to_string(c.byte_offset) +
                      ") lies outside its file " + f.name + " of " + std::to_string(f.bytes) +
                      " bytes");
    }
  }
}

}  // namespace

int64_t Box::numel() const { return product(lengths); }

Box whole(const std::vector<int64_t>& shape) {
  return Box{std::vector<int64_t>(shape.size(), 0), shape};
}

Box intersect(const Box& a, const Box& b) {
  Box out;
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.lengths[d], b.offsets[d] + b.lengths[d]);
    out.offsets.push_back(lo);
    out.lengths.push_back(std::max<int64_t>(0, hi - lo));
  }
  return out;
}

std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  std::vector<Box> out;
  std::vector<int64_t> prefix;
  cut(shape, 0, prefix, begin, end, out);
  return out;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

std::string to_string(const Box& box) {
  std::string s = "[";
  for (size_t d = 0; d < box.offsets.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(box.offsets[d]) + ":" + std::to_string(box.offsets[d] + box.lengths[d]);
  }
  return s + "]";
}

const TensorMeta* Metadata::find(const std::string& fqn) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), fqn,
                             [](const TensorMeta& t, const std::string& n) { return t.fqn < n; });
  return it != tensors.end() && it->fqn == fqn ? &*it : nullptr;
}

std::string tiling_error(const TensorMeta& t) {
  const size_t dims = t.shape.size();
  std::vector<size_t> order;  // the chunks that hold elements, by their first row
  int64_t held = 0;
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const Box& b = t.chunks[i].box;
    if (b.offsets.size() != dims || b.lengths.size() != dims) {
      return "a chunk has another number of dimensions than the shape " + shape_string(t.shape);
    }
    for (size_t d = 0; d < dims; ++d) {
      if (b.offsets[d] < 0 || b.lengths[d] < 0 || b.offsets[d] > t.shape[d] - b.lengths[d]) {
        return "the chunk " + to_string(b) + " lies outside the shape " + shape_string(t.shape);
      }
    }
    if (b.numel() == 0) continue;
    order.push_back(i);
    held += b.numel();  // each is inside the tensor, so no sum of them passes 2^63 unnoticed
    if (held > whole(t.shape).numel()) break;
  }
  // A sweep over the first dimension: only chunks whose rows meet can share
  // an element, so each is compared with those still open at its first row.
  auto first = [&](size_t i) { return dims ? t.chunks[i].box.offsets[0] : 0; };
  auto end = [&](size_t i) { return dims ? first(i) + t.chunks[i].box.lengths[0] : 1; };
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return first(a) < first(b); });
  std::vector<size_t> open;
  for (size_t i : order) {
    open.erase(
        std::remove_if(open.begin(), open.end(), [&](size_t j) { return end(j) <= first(i); }),
        open.end());
    for (size_t j : open) {
      if (intersect(t.chunks[i].box, t.chunks[j].box).numel() > 0) {
        return "the chunks " + to_string(t.chunks[j].box) + " and " + to_string(t.chunks[i].box) +
               " overlap";
      }
    }
    open.push_back(i);
  }
  if (held != whole(t.shape).numel()) {
    return "its chunks hold " + std::to_string(held) + " of its " +
           std::to_string(whole(t.shape).numel()) + " elements";
  }
  return "";
}

std::string dtype_name(torch::Dtype dtype) {
  if (const DtypeInfo* d = find_dtype(dtype)) return d->name;
  throw Unsupported(std::string("distributed checkpoint: dtype ") + c10::toString(dtype) +
                    " is not supported");
}

torch::Dtype dtype_from_name(const std::string& name) {
  if (const DtypeInfo* d = find_dtype(&DtypeInfo::name, name)) return d->dtype;
  throw CheckpointError("distributed checkpoint: unknown dtype '" + name + "'");
}

std::string metadata_to_json(const Metadata& meta) {
  nlohmann::json j;
  j["format"] = "cohort-dcp";
  j["version"] = kFormatVersion;
  j["block_bytes"] = kBlockBytes;
  j["files"] = nlohmann::json::array();
  for (const auto& f : meta.files) j["files"].push_back({{"name", f.name}, {"bytes", f.bytes}});
  j["modules"] = meta.modules;
  j["tensors"] = nlohmann::json::array();
  for (const auto& t : meta.tensors) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const auto& c : t.chunks) {
      chunks.push_back({{"offsets", c.box.offsets},
                        {"lengths", c.box.lengths},
                        {"file", c.file},
                        {"byte_offset", c.byte_offset},
                        {"crc32", c.crc32}});
    }
    j["tensors"].push_back(
        {{"fqn", t.fqn}, {"shape", t.shape}, {"dtype", dtype_name(t.dtype)}, {"chunks", chunks}});
  }
  return j.dump(1);
}

Metadata metadata_from_json(const std::string& text, const std::string& source) {
  Metadata meta;
  try {
    const auto j = nlohmann::json::parse(text);
    if (j.at("format") != "cohort-dcp") bad(source, "not a cohort distributed checkpoint");
    if (j.at("version") != kFormatVersion) {
      bad(source, "format version " + j.at("version").dump() + ", this build reads version " +
                      std::to_string(kFormatVersion));
    }
    if (j.at("block_bytes") != kBlockBytes) bad(source, "checksum block size differs");
    std::set<std::string> file_names;
    for (const auto& f : j.at("files")) {
      meta.files.push_back({f.at("name").get<std::string>(), f.at("bytes").get<int64_t>()});
      const auto& name = meta.files.back().name;
      // A load opens dir + "/" + name: a path would read outside the folder.
      if (name.empty() || name == "." || name == ".." ||
          name.find_first_of(std::string("/\0", 2)) != std::string::npos) {
        bad(source, "file '" + name + "' is not a plain file name");
      }
      if (!file_names.insert(name).second) bad(source, "file " + name + " is listed twice");
      if (meta.files.back().bytes < 0) bad(source, "file " + name + ": negative size");
    }
    meta.modules = j.value("modules", std::vector<std::string>{});
    for (const auto& t : j.at("tensors")) {
      TensorMeta tm;
      tm.fqn = t.at("fqn").get<std::string>();
      tm.shape = t.at("shape").get<std::vector<int64_t>>();
      tm.dtype = dtype_from_name(t.at("dtype"));
      check_shape(tm, source);
      for (const auto& c : t.at("chunks")) {
        ChunkMeta cm;
        cm.box.offsets = c.at("offsets").get<std::vector<int64_t>>();
        cm.box.lengths = c.at("lengths").get<std::vector<int64_t>>();
        cm.file = c.at("file");
        cm.byte_offset = c.at("byte_offset");
        cm.crc32 = c.at("crc32").get<std::vector<uint32_t>>();
        if (cm.box.offsets.size() != tm.shape.size() || cm.box.lengths.size() != tm.shape.size() ||
            cm.file < 0 || cm.file >= static_cast<int>(meta.files.size())) {
          bad(source, "tensor " + tm.fqn + ": a chunk does not fit the tensor or the files");
        }
        tm.chunks.push_back(std::move(cm));
      }
      check_chunks(tm, meta.files, source);
      meta.tensors.push_back(std::move(tm));
    }
  } catch (const nlohmann::json::exception& e) {
    bad(source, std::string("malformed metadata: ") + e.what());
  }
  std::sort(meta.tensors.begin(), meta.tensors.end(),
            [](const TensorMeta& a, const TensorMeta& b) { return a.fqn < b.fqn; });
  // find() would pick one of two entries of a name, and each may tile it.
  for (size_t i = 1; i < meta.tensors.size(); ++i) {
    if (meta.tensors[i].fqn == meta.tensors[i - 1].fqn) {
      bad(source, "tensor " + meta.tensors[i].fqn + " is listed twice");
    }
  }
  return meta;
}

}  // namespace cohort::dcp
