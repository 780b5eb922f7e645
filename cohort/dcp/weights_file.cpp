#include "cohort/dcp/weights_file.h"

#include <functional>
#include <optional>
#include <set>

#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/safetensors.h"
#include "cohort/dcp/torch_file.h"

namespace cohort::dcp {
namespace {

// The file, whichever its format: the names and shapes, and a box's values.
struct WeightsSource {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  std::function<torch::Tensor(const std::string&, const Box&)> read_box;
};

WeightsSource open_weights(const std::string& path) {
  WeightsSource src;
  if (is_torch_file(path)) {
    auto all = std::make_shared<NamedTensors>(load_torch(path));
    for (const auto& item : *all) src.shapes.emplace_back(item.key(), item.value().sizes().vec());
    src.read_box = [all](const std::string& name, const Box& box) {
      auto t = (*all)[name];
      for (size_t d = 0; d < box.offsets.size(); ++d) {
        t = t.narrow(static_cast<int64_t>(d), box.offsets[d], box.lengths[d]);
      }
      return t;
    };
    return src;
  }
  auto file = std::make_shared<SafetensorsFile>(path);
  for (const auto& e : file->entries()) src.shapes.emplace_back(e.name, e.shape);
  src.read_box = [file](const std::string& name, const Box& box) {
    return file->read_box(name, box);
  };
  return src;
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < 8; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > 8) s += ", ... (" + std::to_string(names.size()) + " in all)";
  return s;
}

// Reads every shard the state dict holds into staging tensors, each with
// the shard it fills; returns the error ("" when none) and sets its kind.
using Copies = std::vector<std::pair<torch::Tensor, torch::Tensor>>;  // (shard, staged)
std::string stage(const StateDict& state, const std::string& path,
                  const LoadWeightsOptions& options, Copies& staged, ErrorKind& kind) {
  const auto where = "dcp::load_weights: " + path + ": ";
  // A model refused by check_model (replaced storage): an InvalidArgument,
  // as at save and load; anything met reading the file: a CheckpointError.
  kind = ErrorKind::InvalidArgument;
  try {
    for (const auto& f : state.check_model) f("dcp::load_weights");
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  kind = ErrorKind::Checkpoint;
  try {
    const auto src = open_weights(path);
    std::map<std::string, const std::vector<int64_t>*> in_file;
    for (const auto& [name, shape] : src.shapes) in_file[name] = &shape;
    std::vector<std::string> missing;
    std::set<std::string> held;
    for (const auto& t : state.tensors) {
      if (t.fqn.compare(0, options.prefix.size(), options.prefix) != 0) continue;
      const auto name = t.fqn.substr(options.prefix.size());
      held.insert(name);
      auto it = in_file.find(name);
      if (it == in_file.end()) {
        if (!options.allow_missing) missing.push_back(name);
        continue;
      }
      if (*it->second != t.shape) {
        return where + "tensor " + name + ": the file's shape " + shape_string(*it->second) +
               " is not the model's " + shape_string(t.shape);
      }
      for (const auto& s : t.shards) staged.emplace_back(s.data, src.read_box(name, s.box));
    }
    if (!missing.empty())
      return where + "the model's tensors " + joined(missing) + " are not in it";
    std::vector<std::string> unexpected;
    for (const auto& [name, shape] : src.shapes) {
      if (!held.count(name)) unexpected.push_back(name);
    }
    if (!unexpected.empty() && !options.allow_unexpected) {
      return where + "its tensors " + joined(unexpected) + " are not the model's";
    }
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace

int load_weights(StateDict& state, const std::string& path, const LoadWeightsOptions& options) {
  Copies staged;
  ErrorKind kind = ErrorKind::Checkpoint;
  const auto error = stage(state, path, options, staged, kind);
  if (options.comm) {
    agree(*options.comm, error, kind);
  } else if (!error.empty()) {
    if (kind == ErrorKind::InvalidArgument) throw InvalidArgument(error);
    if (kind == ErrorKind::Config) throw ConfigError(error);
    throw CheckpointError(error);
  }
  // Every rank read and checked all it needs: only now does anything change.
  torch::NoGradGuard no_grad;
  std::set<torch::TensorImpl*> filled;
  for (auto& [shard, values] : staged) {
    shard.copy_(values);
    filled.insert(shard.unsafeGetTensorImpl());
  }
  return static_cast<int>(filled.size());
}

}  // namespace cohort::dcp
