#include "ckpt_files.h"

#include <torch/serialize/output-archive.h>

#include <cstdio>
#include <map>
#include <memory>
#include <set>

#include "cohort/comm/init.h"
#include "cohort/core/store/hash_store.h"
#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/dcp.h"
#include "cohort/dcp/torch_file.h"

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

// The archive of the module holding tensor `name` ("a.b.weight": a's b).
Node* node_of(Node& root, const std::string& name) {
  Node* node = &root;
  for (size_t at = 0, dot; (dot = name.find('.', at)) != std::string::npos; at = dot + 1) {
    node = &node->children[name.substr(at, dot - at)];
  }
  return node;
}

std::string leaf_name(const std::string& name) { return name.substr(name.rfind('.') + 1); }

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

cohort::dcp::NamedTensors model_tensors(const std::string& dir, const std::string& prefix) {
  const auto meta = cohort::dcp::read_metadata(dir);
  cohort::dcp::NamedTensors out;
  for (const auto& t : meta.tensors) {
    if (t.fqn.compare(0, prefix.size(), prefix) != 0) continue;
    out.insert(t.fqn.substr(prefix.size()), cohort::dcp::read_tensor(dir, meta, t.fqn));
  }
  if (out.is_empty()) {
    throw cohort::CheckpointError("checkpoint " + dir + ": no tensor named " + prefix + "*");
  }
  return out;
}

int consolidate_checkpoint(const std::string& dir, const std::string& out,
                           const std::string& prefix) {
  const auto tensors = model_tensors(dir, prefix);
  const auto meta = cohort::dcp::read_metadata(dir);
  Node root;
  // Every submodule gets its archive, parameterless ones too: Module::load
  // reads one per child.
  for (const auto& m : meta.modules) {
    if (m.compare(0, prefix.size(), prefix) == 0) node_of(root, m.substr(prefix.size()) + ".x");
  }
  for (const auto& item : tensors) {
    node_of(root, item.key())->tensors.emplace_back(leaf_name(item.key()), item.value());
  }
  torch::serialize::OutputArchive archive;
  root.write(archive);
  archive.save_to(out);
  return static_cast<int>(tensors.size());
}

std::vector<std::string> export_checkpoint(const std::string& dir, const std::string& out,
                                           const ExportOptions& options) {
  const auto tensors = model_tensors(dir, options.prefix);
  if (options.format == "torch") {
    cohort::dcp::save_torch(tensors, out);
    return {out};
  }
  if (options.format != "safetensors") {
    throw cohort::ConfigError("cohort-ckpt export: unknown format '" + options.format +
                              "' (safetensors or torch)");
  }
  cohort::dcp::SafetensorsOptions st;
  st.metadata = {{"format", "pt"}};  // transformers refuses a file without it
  st.max_shard_bytes = options.max_shard_bytes;
  return cohort::dcp::save_safetensors(tensors, out, st);
}

int import_weights(const std::string& file, const std::string& dir, const std::string& prefix) {
  const auto tensors = cohort::dcp::is_torch_file(file) ? cohort::dcp::load_torch(file)
                                                        : cohort::dcp::load_safetensors(file);
  cohort::dcp::StateDict state;
  std::set<std::string> modules;
  for (const auto& item : tensors) {
    const auto shape = item.value().sizes().vec();
    state.tensors.push_back({prefix + item.key(),
                             shape,
                             item.value().scalar_type(),
                             true,
                             {{cohort::dcp::whole(shape), item.value()}}});
    // Every module the names imply (a.b.weight: a and a.b).
    for (auto dot = item.key().find('.'); dot != std::string::npos;
         dot = item.key().find('.', dot + 1)) {
      modules.insert(prefix + item.key().substr(0, dot));
    }
  }
  state.modules.assign(modules.begin(), modules.end());
  auto comm = cohort::connect(std::make_shared<cohort::HashStore>(), 0, 1);
  cohort::dcp::save(state, dir, *comm);
  return static_cast<int>(tensors.size());
}

}  // namespace cohort_ckpt
