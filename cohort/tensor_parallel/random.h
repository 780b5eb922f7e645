// defines: RngTracker, one rank's named random streams under tensor
// parallelism (Megatron-LM's RNG tracker, as explicit generators), and
// dropout with a generator.
//
// Dropout under TP must drop the same elements on every TP rank where the
// ranks hold the same activations (replicated regions: the residual stream
// and the embeddings without sequence parallelism), or the ranks compute
// from different inputs and their replicated parameters drift apart; and
// other elements where each holds its own part (sharded regions: the
// attention probabilities of its heads, its slice of the sequence under
// sequence parallelism). LibTorch's default generator serves neither:
// ranks as threads share it, ranks as processes are seeded as the program
// chose, and a resumed Trainer restores each rank's own. A tracker is one
// rank's generators, one per stream and device, that no other rank or
// thread draws from:
//
//   RngTracker rng(mesh, seed);
//   h = h + dropout(y, p, is_training(), rng->replicated(y.device()));
//   probs = dropout(probs, p, is_training(), rng->model_parallel(probs.device()));
//
// Seeds, g being the index of this rank's TP group in the mesh (its
// coordinates along every dimension but "tp", row-major; 0 on a mesh of
// "tp" alone) and s = seed + kGroupStride * g:
//   "replicated"      s                                 every TP rank of the group alike
//   "model-parallel"  s + kModelParallelOffset + tp_rank  each TP rank its own
// as Megatron-LM's model_parallel_cuda_manual_seed (offset 2718). Every
// device has its own generator of each stream, made at its first use (or by
// `to(device)`) from the stream's current seed: the seed above, or once the
// stream was restarted (reseed) the restart's, which state() carries. So a
// generator made after a restart starts where one that existed then was
// put, not at the original stream. Each is a clone of that device's default
// generator, seeded (so a build without CUDA compiles the same code, and
// the CPU's takes the path a CUDA device's does).
//
// The tracker is a module without parameters: registered in a model, the
// Trainer checkpoints its streams with each rank's RNG states and a resume
// continues them (RngStreams, cohort/train/rng_state.h); `to(device)` makes
// that device's generators. Activation checkpointing must restore them for
// the recompute: pass generators(device) as CheckpointOptions::generators.
#pragma once

#include <ATen/core/Generator.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/train/rng_state.h"

namespace cohort::tensor_parallel {

/// One rank's named random streams (see the file comment).
class RngTrackerImpl : public torch::nn::Module, public RngStreams {
 public:
  static constexpr const char* kReplicated = "replicated";         ///< alike on the TP group
  static constexpr const char* kModelParallel = "model-parallel";  ///< each TP rank its own
  static constexpr uint64_t kModelParallelOffset = 2718;           ///< Megatron-LM's
  static constexpr uint64_t kGroupStride = 1000003;  ///< keeps every TP group's seeds apart

  /// The two streams of this rank, from `mesh`'s "tp" dimension
  /// (InvalidArgument when it has none) and `seed`.
  RngTrackerImpl(const DeviceMesh& mesh, uint64_t seed);

  /// Adds stream `name` seeded with `seed` (the same on the TP ranks for a
  /// replicated region). InvalidArgument when the name or the seed is taken.
  void add(const std::string& name, uint64_t seed);
  /// The streams' names, sorted.
  std::vector<std::string> names() const;
  /// Stream `name`'s seed, as add() gave it (InvalidArgument naming the
  /// streams when there is none).
  uint64_t seed(const std::string& name) const;

  /// Stream `name`'s generator on `device` (made on first use).
  at::Generator generator(const std::string& name, const torch::Device& device);
  /// The replicated stream's generator on `device`.
  at::Generator replicated(const torch::Device& device) { return generator(kReplicated, device); }
  /// The model-parallel stream's generator on `device`.
  at::Generator model_parallel(const torch::Device& device) {
    return generator(kModelParallel, device);
  }
  /// Every stream's generator on `device` (CheckpointOptions::generators).
  std::vector<at::Generator> generators(const torch::Device& device);

  /// Every generator's state, with this rank's place in the TP group.
  torch::Tensor state() const;
  /// Restores state() of a tracker with the same streams at the same TP
  /// rank, the streams' current seeds with it (a state written before they
  /// were saved leaves them); a generator of a device it does not hold
  /// starts over at its stream's current seed, as one made after the
  /// restore. InvalidArgument naming what differs otherwise, with nothing
  /// changed.
  void set_state(const torch::Tensor& state);
  /// Restarts every stream from a mix of its seed and `step`: its
  /// generators, and those it makes from now on.
  void reseed(uint64_t step);

  /// RngStreams: state().
  torch::Tensor rng_state() const override { return state(); }
  /// RngStreams, collective over the TP group: `state` continues only when
  /// every rank of the group restores the state of the same TP group of the
  /// job that wrote it at its own TP rank (so the replicated stream still
  /// agrees); otherwise every rank of the group reseeds(step).
  void restore_rng_state(const torch::Tensor& state, int64_t step) override;

  using torch::nn::Module::to;
  /// Makes `device`'s generators (none for a device without an index but the CPU).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  /// As above, the dtype aside (generators have none).
  void to(torch::Device device, bool non_blocking = false) override;
  /// "cohort::tensor_parallel::RngTracker(tp_rank=…, tp_size=…, group=…)".
  void pretty_print(std::ostream& stream) const override;

  int tp_rank() const { return tp_rank_; }   ///< this rank's coordinate along "tp"
  int tp_size() const { return tp_size_; }   ///< the TP group's size
  uint64_t group() const { return group_; }  ///< g: this rank's TP group in the mesh

 private:
  struct Stream {
    uint64_t seed = 0;     // add()'s
    uint64_t current = 0;  // a generator made now is seeded with it: seed, or a restart's
    std::vector<std::pair<torch::Device, at::Generator>> generators;  // by device
  };
  // A state checked against this tracker, with what it sets: the
  // generators it holds, those it does not (reseeded), the current seeds.
  struct Prepared {
    uint64_t group = 0;
    std::vector<std::pair<at::Generator, torch::Tensor>> updates;
    std::vector<std::pair<at::Generator, uint64_t>> restarts;
    std::vector<std::pair<std::string, uint64_t>> currents;  // by stream name
  };
  Prepared prepare(const torch::Tensor& state);  // InvalidArgument when it does not fit
  void commit(Prepared& prepared);
  // The stream's generator on `device`, made if missing; mu_ held.
  at::Generator generator_locked(Stream& stream, const torch::Device& device);
  Stream& stream_locked(const std::string& name);

  std::shared_ptr<Communicator> tp_;
  int tp_rank_ = 0, tp_size_ = 1;
  uint64_t group_ = 0;
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, Stream>> streams_;  // sorted by name
};
TORCH_MODULE(RngTracker);

/// Dropout drawing its mask from `generator`, which must be of the input's
/// device: in training with 0 < p < 1, `input * (keep / (1 - p))`, where
/// keep = empty(input.sizes(), input.options()).bernoulli_(1 - p,
/// generator), drawn in row-major order whatever the input's strides (so
/// that a reference can draw the same mask); zeros at p = 1; the input
/// itself when not training or at p = 0. InvalidArgument for p outside
/// [0, 1], an undefined generator, or one of another device.
torch::Tensor dropout(const torch::Tensor& input, double p, bool train, at::Generator generator);

}  // namespace cohort::tensor_parallel
