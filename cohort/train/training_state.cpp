#include "cohort/train/training_state.h"

#include <torch/serialize/archive.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <sstream>

#include "cohort/dcp/checkpoint_file.h"

namespace cohort {

std::string encode_training_state(const TrainingPosition& position, const torch::Tensor& rng_states,
                                  const std::vector<std::string>& initial_lr_records,
                                  const torch::Tensor& device_rng_states,
                                  const torch::Tensor& rng_streams) {
  torch::serialize::OutputArchive archive;
  archive.write("step", c10::IValue(position.step));
  archive.write("epoch", c10::IValue(position.epoch));
  archive.write("batch", c10::IValue(position.batch));
  archive.write("epoch_samples", c10::IValue(position.epoch_samples));
  archive.write("epoch_batches", c10::IValue(position.epoch_batches));
  archive.write("global_batch", c10::IValue(position.global_batch));
  archive.write("data_order", c10::IValue(position.data_order));
  archive.write("data_samples", c10::IValue(position.data_samples));
  archive.write("data_parallel", c10::IValue(position.data_parallel));
  archive.write("rng_states", rng_states);
  if (device_rng_states.defined()) archive.write("device_rng_states", device_rng_states);
  if (rng_streams.defined()) archive.write("rng_streams", rng_streams);
  if (!initial_lr_records.empty()) {
    // One zero-padded row of text per rank.
    size_t longest = 1;
    for (const auto& r : initial_lr_records) longest = std::max(longest, r.size() + 1);
    auto rows = torch::zeros(
        {static_cast<int64_t>(initial_lr_records.size()), static_cast<int64_t>(longest)},
        torch::kUInt8);
    for (size_t r = 0; r < initial_lr_records.size(); ++r) {
      std::memcpy(rows[static_cast<int64_t>(r)].data_ptr<uint8_t>(), initial_lr_records[r].data(),
                  initial_lr_records[r].size());
    }
    archive.write("initial_lr_records", rows);
  }
  archive.write("dcp", c10::IValue(true));
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

namespace {

// Runs `fn`, naming `source` in what it throws: the checksum passed, so a
// failure is a payload this version cannot read; said so rather than with
// LibTorch's backtrace.
void as_unreadable(const std::string& source, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    throw CheckpointError("checkpoint " + source +
                          ": its training state does not parse: " + e.what_without_backtrace());
  }
}

}  // namespace

DecodedState decode_training_state(const std::string& payload, const std::string& source,
                                   const CheckpointCheck& check) {
  torch::serialize::InputArchive archive;
  DecodedState state;
  CheckpointKind kind;
  as_unreadable(source, [&] {
    std::istringstream in(payload);
    archive.load_from(in);
    archive.read("rng_states", state.rng_states);
    c10::IValue v;
    kind.in_dcp = archive.try_read("dcp", v) && v.toBool();
    // An earlier cohort wrote the model (and optimizer) into this archive.
    torch::serialize::InputArchive model_archive;
    kind.model_in_file = archive.try_read("model", model_archive) && !model_archive.keys().empty();
    kind.world = state.rng_states.size(0);
  });
  if (check) check(kind);  // what it throws, as it is
  as_unreadable(source, [&] {
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
    state.position.global_batch = archive.try_read("global_batch", v) ? v.toInt() : 0;
    state.position.data_order = archive.try_read("data_order", v) ? v.toStringRef() : "";
    state.position.data_samples = archive.try_read("data_samples", v) ? v.toInt() : -1;
    state.position.data_parallel = archive.try_read("data_parallel", v) ? v.toInt() : 0;
    archive.try_read("device_rng_states", state.device_rng_states);
    archive.try_read("rng_streams", state.rng_streams);
    torch::Tensor records;
    if (archive.try_read("initial_lr_records", records)) {
      records = records.to(torch::kUInt8).contiguous();
      for (int64_t r = 0; r < records.size(0); ++r) {
        const auto* row = reinterpret_cast<const char*>(records[r].data_ptr<uint8_t>());
        state.initial_lr_records.emplace_back(row, strnlen(row, records.size(1)));
      }
    }
    torch::Tensor lrs;
    if (archive.try_read("initial_lrs", lrs)) {
      lrs = lrs.to(torch::kFloat64).contiguous();
      state.initial_lrs.assign(lrs.data_ptr<double>(), lrs.data_ptr<double>() + lrs.numel());
    }
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
