#include "cohort/train/training_state.h"

#include <torch/serialize/archive.h>

#include <functional>
#include <set>
#include <sstream>
#include <vector>

#include "cohort/dcp/checkpoint_file.h"

namespace cohort {

namespace {

struct Assignment {
  torch::Tensor target, loaded;
};

std::string shape_text(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

// Reads every parameter, buffer and child of `module` from `archive`, checking
// that the names are the same on both sides and that each tensor has the
// model's shape and dtype (copy_ would broadcast a [1] into any shape).
// Throws CheckpointError naming the key; copies nothing.
void collect(torch::nn::Module& module, torch::serialize::InputArchive& archive,
             const std::string& prefix, std::vector<Assignment>& out) {
  std::set<std::string> expected;
  auto take = [&](const std::string& name, const torch::Tensor& target, bool is_buffer) {
    expected.insert(name);
    const std::string key = prefix + name;
    torch::Tensor loaded;
    if (!archive.try_read(name, loaded, is_buffer)) {
      throw CheckpointError("'" + key + "' is missing from the checkpoint");
    }
    if (!target.defined() || !loaded.defined()) {
      if (target.defined() != loaded.defined()) {
        throw CheckpointError("'" + key + "' is defined on one side only");
      }
      return;
    }
    if (loaded.sizes() != target.sizes() || loaded.scalar_type() != target.scalar_type()) {
      throw CheckpointError("'" + key + "' is " + shape_text(loaded.sizes()) + " " +
                            c10::toString(loaded.scalar_type()) + " in the checkpoint, " +
                            shape_text(target.sizes()) + " " + c10::toString(target.scalar_type()) +
                            " in the model");
    }
    out.push_back({target, loaded});
  };
  for (auto& p : module.named_parameters(/*recurse=*/false)) take(p.key(), p.value(), false);
  for (auto& b : module.named_buffers(/*recurse=*/false)) take(b.key(), b.value(), true);
  for (auto& child : module.named_children()) {
    expected.insert(child.key());
    torch::serialize::InputArchive sub;
    if (!archive.try_read(child.key(), sub)) {
      throw CheckpointError("module '" + prefix + child.key() + "' is missing from the checkpoint");
    }
    collect(*child.value(), sub, prefix + child.key() + ".", out);
  }
  for (const auto& key : archive.keys()) {
    if (!expected.count(key)) {
      throw CheckpointError("'" + prefix + key + "' is in the checkpoint but not in the model");
    }
  }
}

}  // namespace

// Module::load would set_() each parameter to the loaded storage (and
// LibTorch then gives it a new gradient accumulator, which DDP re-hooks at
// the next forward); copying into the existing storage instead keeps
// anything that holds views of the weights (flat optimizer buffers) valid.
// Everything is checked before anything is copied.
void load_module_state(torch::nn::Module& module, torch::serialize::InputArchive& archive) {
  std::vector<Assignment> all;
  collect(module, archive, "", all);
  torch::NoGradGuard no_grad;
  for (auto& a : all) a.target.copy_(a.loaded);
}

std::string encode_training_state(torch::nn::Module* model, const TrainerOptimizer& optimizer,
                                  const TrainingPosition& position, const torch::Tensor& rng_states,
                                  bool in_dcp) {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model_archive, optimizer_archive;
  if (model) model->save(model_archive);
  // A sharded optimizer (ZeRO) is saved in the dcp folder.
  if (optimizer.replicated_state() && !in_dcp) optimizer.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("step", c10::IValue(position.step));
  archive.write("epoch", c10::IValue(position.epoch));
  archive.write("batch", c10::IValue(position.batch));
  archive.write("epoch_samples", c10::IValue(position.epoch_samples));
  archive.write("epoch_batches", c10::IValue(position.epoch_batches));
  archive.write("rng_states", rng_states);
  if (in_dcp) archive.write("dcp", c10::IValue(true));
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

namespace {

// Runs `fn`, naming `source` in what it throws: the checksum passed, so a
// failure is a checkpoint of another model or optimizer; said so rather
// than with LibTorch's backtrace.
void as_misfit(const std::string& source, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const CheckpointError& e) {
    throw CheckpointError("checkpoint " + source + ": does not fit this model: " + e.what());
  } catch (const c10::Error& e) {
    throw CheckpointError("checkpoint " + source +
                          ": does not fit this model/optimizer: " + e.what_without_backtrace());
  }
}

}  // namespace

DecodedState decode_training_state(const std::string& payload, const std::string& source,
                                   torch::nn::Module* model, TrainerOptimizer& optimizer,
                                   const CheckpointCheck& check) {
  torch::serialize::InputArchive archive, model_archive;
  DecodedState state;
  CheckpointKind kind;
  as_misfit(source, [&] {
    std::istringstream in(payload);
    archive.load_from(in);
    archive.read("rng_states", state.rng_states);
    c10::IValue v;
    state.in_dcp = archive.try_read("dcp", v) && v.toBool();
    archive.read("model", model_archive);
    kind = {state.rng_states.size(0), state.in_dcp, !model_archive.keys().empty()};
  });
  if (check) check(kind);  // what it throws, as it is
  as_misfit(source, [&] {
    if (!state.in_dcp) {
      torch::serialize::InputArchive optimizer_archive;
      archive.read("optimizer", optimizer_archive);
      if (model) load_module_state(*model, model_archive);
      if (optimizer.replicated_state()) optimizer.load(optimizer_archive);
    }
    c10::IValue v;
    archive.read("step", v);
    state.position.step = v.toInt();
    archive.read("epoch", v);
    state.position.epoch = v.toInt();
    archive.read("batch", v);
    state.position.batch = v.toInt();
    // Older checkpoints: the epoch's order is unknown, same-size resume only.
    state.position.epoch_samples = archive.try_read("epoch_samples", v) ? v.toInt() : -1;
    state.position.epoch_batches = archive.try_read("epoch_batches", v) ? v.toInt() : 0;
  });
  return state;
}

bool training_state_in_dcp(const std::string& payload, const std::string& source) {
  try {
    std::istringstream in(payload);
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    c10::IValue v;
    return archive.try_read("dcp", v) && v.toBool();
  } catch (const c10::Error& e) {
    throw CheckpointError("checkpoint " + source + ": " + e.what_without_backtrace());
  }
}

}  // namespace cohort
