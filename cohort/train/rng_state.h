// defines: cpu_rng_state / set_cpu_rng_state, the state of LibTorch's
// default CPU generator (dropout, randn, ...) as a uint8 tensor, so that a
// resumed run draws the same numbers as an uninterrupted one; RngStreams,
// the random streams a model keeps of its own, and their checkpoint form;
// DefaultRngStatesKept, which undoes a read's draws from the default
// generators.
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace cohort {

torch::Tensor cpu_rng_state();
void set_cpu_rng_state(const torch::Tensor& state);
/// The state of a fresh CPU generator seeded with `seed` (for a rank that a
/// checkpoint has no state of: a job resumed at a bigger world size).
torch::Tensor seeded_cpu_rng_state(uint64_t seed);

/// The state of the default generator of `device` (a CUDA device's:
/// dropout on the GPU draws from it), as a CPU uint8 tensor, and its
/// restore. Through at::Context, so that a build without CUDA compiles the
/// same code.
torch::Tensor device_rng_state(const torch::Device& device);
void set_device_rng_state(const torch::Device& device, const torch::Tensor& state);
/// Seeds the default generator of `device`.
void seed_device_rng(const torch::Device& device, uint64_t seed);
/// Throws c10::Error where set_device_rng_state would, without changing the
/// generator (the state is set on a copy of it): a resume checks a
/// checkpoint's states before it loads anything, and sets them only once
/// the load succeeded.
void check_device_rng_state(const torch::Device& device, const torch::Tensor& state);

/// While it lives, draws from LibTorch's default generators are undone on
/// its destruction: the CPU generator's state and, where CUDA is available,
/// every CUDA device's are restored to what they were at its construction.
/// The Trainer reads a micro-batch outside the training order (to check
/// the ranks' samples, to count the global batch) under one, so that a
/// DataSource augmenting from the default generators draws the same numbers
/// in the steps whether or not such reads happened (a resumed run makes
/// reads the uninterrupted one does not).
class DefaultRngStatesKept {
 public:
  DefaultRngStatesKept();
  ~DefaultRngStatesKept();
  DefaultRngStatesKept(const DefaultRngStatesKept&) = delete;
  DefaultRngStatesKept& operator=(const DefaultRngStatesKept&) = delete;

 private:
  torch::Tensor cpu_;
  std::vector<torch::Tensor> cuda_;  // per CUDA device, in index order
};

/// Random streams of a model's own: explicit generators that a module of
/// the model draws from instead of LibTorch's default ones
/// (tensor_parallel::RngTracker). A module of the model that is one is
/// found by the Trainer, which checkpoints its state with each rank's RNG
/// states and restores it on resume.
class RngStreams {
 public:
  virtual ~RngStreams() = default;
  /// This rank's streams as a uint8 tensor.
  virtual torch::Tensor rng_state() const = 0;
  /// Collective: called on every rank of the job at once. `state` is what
  /// rng_state() returned on this rank when checkpoint `step` was written,
  /// undefined when the checkpoint has none for it (a rank new to the job,
  /// a checkpoint written without these streams); streams that cannot
  /// continue from it restart in a way fixed by `step`.
  virtual void restore_rng_state(const torch::Tensor& state, int64_t step) = 0;
};

/// The modules of `model` (itself included) that are RngStreams, each once,
/// in module order.
std::vector<RngStreams*> rng_streams_of(const torch::nn::Module& model);
/// Their states in one uint8 tensor (empty when there are none): each
/// stream set's length and bytes, so that trailing zeros (padding to
/// another rank's length) are ignored on restore.
torch::Tensor rng_streams_state(const std::vector<RngStreams*>& streams);
/// Collective, as RngStreams::restore_rng_state: gives each stream set its
/// part of `state` (rng_streams_state's; undefined: none), or undefined to
/// every one when `state` holds another number of them.
void restore_rng_streams(const std::vector<RngStreams*>& streams, const torch::Tensor& state,
                         int64_t step);

}  // namespace cohort
