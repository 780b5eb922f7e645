#include "ckpt_files.h"

#include <torch/serialize/output-archive.h>

#include <cstdio>
#include <map>
#include <memory>

#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/dcp.h"

namespace cohort_ckpt {
namespace {

using cohort::dcp::Box;
using cohort::dcp::TensorMeta;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

// How the tensor was held when saved, from its chunks.
std::string layout_of(const TensorMeta& t) {
  if (t.chunks.empty()) return "empty";
  if (t.chunks.size() == 1 && t.chunks[0].box == cohort::dcp::whole(t.shape)) return "whole";
  bool rows = true;
  for (const auto& c : t.chunks) {
    for (size_t d = 1; d < t.shape.size(); ++d) {
      rows = rows && c.box.offsets[d] == 0 && c.box.lengths[d] == t.shape[d];
    }
  }
  return std::to_string(t.chunks.size()) + (rows ? " dim-0 shards" : " boxes");
}

// The module tree torch::save writes: a nested archive per submodule.
struct Node {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  std::map<std::string, Node> children;
  void write(torch::serialize::OutputArchive& archive) const {
    for (const auto& [name, t] : tensors) archive.write(name, t);
    for (const auto& [name, child] : children) {
      torch::serialize::OutputArchive sub(archive.compilation_unit());
      child.write(sub);
      archive.write(name, sub);
    }
  }
};

}  // namespace

std::string inspect_checkpoint(const std::string& dir, bool verify) {
  const auto meta = cohort::dcp::read_metadata(dir);
  std::string out;
  char line[160];
  int64_t bytes = 0;
  for (const auto& f : meta.files) bytes += f.bytes;
  std::snprintf(line, sizeof(line), "%zu tensors in %zu files, %lld bytes\n", meta.tensors.size(),
                meta.files.size(), static_cast<long long>(bytes));
  out += line;
  for (const auto& t : meta.tensors) {
    out += t.fqn + "  " + cohort::dcp::dtype_name(t.dtype) + " " + shape_text(t.shape) + "  " +
           layout_of(t) + "\n";
    for (const auto& c : t.chunks) {
      out += "    " + meta.files[c.file].name + " @" + std::to_string(c.byte_offset) + "  " +
             cohort::dcp::to_string(c.box) + "  crc32";
      for (auto crc : c.crc32) {
        std::snprintf(line, sizeof(line), " %08x", crc);
        out += line;
      }
      out += "\n";
    }
    if (verify) cohort::dcp::read_tensor(dir, meta, t.fqn);
  }
  if (verify) out += "every chunk's checksums verified\n";
  return out;
}

int consolidate_checkpoint(const std::string& dir, const std::string& out,
                           const std::string& prefix) {
  const auto meta = cohort::dcp::read_metadata(dir);
  Node root;
  // Every submodule gets its archive, parameterless ones too: Module::load
  // reads one per child.
  for (const auto& m : meta.modules) {
    if (m.compare(0, prefix.size(), prefix) != 0) continue;
    Node* node = &root;
    std::string name = m.substr(prefix.size());
    for (auto dot = name.find('.'); dot != std::string::npos; dot = name.find('.')) {
      node = &node->children[name.substr(0, dot)];
      name = name.substr(dot + 1);
    }
    node->children[name];
  }
  int n = 0;
  for (const auto& t : meta.tensors) {
    if (t.fqn.compare(0, prefix.size(), prefix) != 0) continue;
    std::string name = t.fqn.substr(prefix.size());
    Node* node = &root;
    for (auto dot = name.find('.'); dot != std::string::npos; dot = name.find('.')) {
      node = &node->children[name.substr(0, dot)];
      name = name.substr(dot + 1);
    }
    node->tensors.emplace_back(name, cohort::dcp::read_tensor(dir, meta, t.fqn));
    ++n;
  }
  if (n == 0) {
    throw cohort::CheckpointError("checkpoint " + dir + ": no tensor named " + prefix + "*");
  }
  torch::serialize::OutputArchive archive;
  root.write(archive);
  archive.save_to(out);
  return n;
}

}  // namespace cohort_ckpt
