#include "cohort/train/training_state.h"

#include <torch/serialize/archive.h>

#include <sstream>

#include "cohort/train/checkpoint_file.h"

namespace cohort {

// Module::load would set_() each parameter to the loaded storage (and
// LibTorch then gives it a new gradient accumulator, which DDP re-hooks at
// the next forward); copying into the existing storage instead keeps
// anything that holds views of the weights (flat optimizer buffers) valid.
void load_module_state(torch::nn::Module& module, torch::serialize::InputArchive& archive) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.named_parameters(/*recurse=*/false)) {
    torch::Tensor loaded;
    archive.read(p.key(), loaded);
    p.value().copy_(loaded);
  }
  for (auto& b : module.named_buffers(/*recurse=*/false)) {
    torch::Tensor loaded;
    archive.read(b.key(), loaded, /*is_buffer=*/true);
    b.value().copy_(loaded);
  }
  for (auto& child : module.named_children()) {
    torch::serialize::InputArchive sub;
    archive.read(child.key(), sub);
    load_module_state(*child.value(), sub);
  }
}

std::string encode_training_state(torch::nn::Module* model, const TrainerOptimizer& optimizer,
                                  const TrainingPosition& position,
                                  const torch::Tensor& rng_states) {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model_archive, optimizer_archive;
  if (model) model->save(model_archive);
  // A sharded optimizer (ZeRO) saves each rank's part in its own file.
  if (optimizer.replicated_state()) optimizer.save(optimizer_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  archive.write("step", c10::IValue(position.step));
  archive.write("epoch", c10::IValue(position.epoch));
  archive.write("batch", c10::IValue(position.batch));
  archive.write("rng_states", rng_states);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

DecodedState decode_training_state(const std::string& payload, const std::string& source,
                                   torch::nn::Module* model, TrainerOptimizer& optimizer) {
  try {
    std::istringstream in(payload);
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    torch::serialize::InputArchive model_archive, optimizer_archive;
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    if (model) load_module_state(*model, model_archive);
    if (optimizer.replicated_state()) optimizer.load(optimizer_archive);
    DecodedState state;
    c10::IValue v;
    archive.read("step", v);
    state.position.step = v.toInt();
    archive.read("epoch", v);
    state.position.epoch = v.toInt();
    archive.read("batch", v);
    state.position.batch = v.toInt();
    archive.read("rng_states", state.rng_states);
    return state;
  } catch (const c10::Error& e) {
    // The checksum passed, so this is a checkpoint of another model or
    // optimizer; say so rather than print LibTorch's backtrace.
    throw CheckpointError("checkpoint " + source + ": does not fit this model/optimizer: " +
                          e.what_without_backtrace());
  }
}

}  // namespace cohort
