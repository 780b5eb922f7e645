#include "cohort/dcp/metadata.h"

#include <algorithm>
#include <nlohmann/json.hpp>

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

namespace {
const std::vector<std::pair<torch::Dtype, const char*>>& dtype_names() {
  static const std::vector<std::pair<torch::Dtype, const char*>> names = {
      {torch::kFloat, "float32"},     {torch::kDouble, "float64"}, {torch::kHalf, "float16"},
      {torch::kBFloat16, "bfloat16"}, {torch::kLong, "int64"},     {torch::kInt, "int32"},
      {torch::kShort, "int16"},       {torch::kChar, "int8"},      {torch::kByte, "uint8"},
      {torch::kBool, "bool"}};
  return names;
}
}  // namespace

std::string dtype_name(torch::Dtype dtype) {
  for (const auto& [d, n] : dtype_names()) {
    if (d == dtype) return n;
  }
  throw Unsupported(std::string("distributed checkpoint: dtype ") + c10::toString(dtype) +
                    " is not supported");
}

torch::Dtype dtype_from_name(const std::string& name) {
  for (const auto& [d, n] : dtype_names()) {
    if (n == name) return d;
  }
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
    for (const auto& f : j.at("files"))
      meta.files.push_back({f.at("name").get<std::string>(), f.at("bytes").get<int64_t>()});
    meta.modules = j.value("modules", std::vector<std::string>{});
    for (const auto& t : j.at("tensors")) {
      TensorMeta tm;
      tm.fqn = t.at("fqn").get<std::string>();
      tm.shape = t.at("shape").get<std::vector<int64_t>>();
      tm.dtype = dtype_from_name(t.at("dtype"));
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
      meta.tensors.push_back(std::move(tm));
    }
  } catch (const nlohmann::json::exception& e) {
    bad(source, std::string("malformed metadata: ") + e.what());
  }
  std::sort(meta.tensors.begin(), meta.tensors.end(),
            [](const TensorMeta& a, const TensorMeta& b) { return a.fqn < b.fqn; });
  return meta;
}

}  // namespace cohort::dcp
