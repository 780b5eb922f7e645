// defines: DistributedSampler, DistributedSamplerOptions: PyTorch's
// torch.utils.data.DistributedSampler for LibTorch's data loader.
//
//   cohort::data::DistributedSampler sampler(dataset.size().value(), *comm);
//   auto loader = torch::data::make_data_loader(dataset, sampler, batch_size);
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);   // the loader's copy sees it
//     for (auto& batch : *loader) ...
//   }
//
// make_data_loader keeps its own copy of the sampler, so an epoch stored in
// the sampler could never be changed once the loader holds it (every epoch
// would see the same order, as with LibTorch's DistributedRandomSampler).
// Copies of a DistributedSampler share their epoch instead: set_epoch on
// any copy takes effect at every copy's next reset(), which the loader
// calls when an epoch's iteration begins.
//
// The constructors with a Communicator are collective: ranks that would
// deal from different orders or leave shares to no rank are refused on
// every rank, and, given the data-parallel group, so are ranks that must
// see the same samples but asked for different replicas (see them). The epoch is not compared
// across ranks: a rank whose set_epoch was given another value, or not called, deals its share of
// another epoch's order unnoticed. A check there would be a collective in
// reset() or set_epoch(), run as many times on every rank; but reset() also
// runs at every loader's begin(), at load() and wherever a program calls it,
// so a rank that iterates its loader once more or less (an evaluation pass
// on rank 0 alone, a break) would leave its peers waiting in it until their
// timeout, and every copy would have to keep the communicator alive.
#pragma once

#include <c10/util/Optional.h>  // c10::optional, which the sampler interface names
#include <torch/data/samplers/base.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cohort {
class Communicator;
}

namespace cohort::data {

/// How a DistributedSampler deals the dataset (the arguments of PyTorch's).
struct DistributedSamplerOptions {
  /// Ranks that share the dataset; unset: the communicator's size (the
  /// data-parallel group's, where the constructor takes one).
  std::optional<int> num_replicas;
  /// This rank's place in [0, num_replicas); unset: the communicator's rank
  /// (the data-parallel group's).
  std::optional<int> rank;
  /// Each epoch permutes the dataset: torch.randperm with a CPU generator
  /// seeded `seed + epoch`, the same on every rank.
  bool shuffle = true;
  /// The permutation's seed; the same on every rank (the constructor with a
  /// Communicator refuses ranks that differ).
  uint64_t seed = 0;
  /// Drops the tail that does not divide evenly over the ranks; otherwise
  /// the order is padded by repeating it from its start.
  bool drop_last = false;
};

/// A sampler for torch::data::make_data_loader that gives each rank its
/// share of the dataset, index for index as PyTorch's DistributedSampler:
/// the epoch's order (permuted, or 0..n-1) is padded to, or cut at, a
/// multiple of num_replicas, and rank r takes its elements r, r +
/// num_replicas, .... Copies share the epoch (see the file comment).
class DistributedSampler : public torch::data::samplers::Sampler<> {
 public:
  /// Over `dataset_size` samples, with num_replicas and rank from `comm`
  /// unless `options` sets them. Collective over `comm` (one all-gather of
  /// seven words; none at size 1); `comm` is not kept. Throws InvalidArgument
  /// on every rank, naming each group of ranks with its value, when the
  /// ranks differ in dataset_size, seed, shuffle, drop_last or
  /// num_replicas, when a rank's rank is out of range, or when the ranks do
  /// not take the num_replicas replicas evenly (two ranks on one rank of a
  /// communicator of num_replicas ranks; ranks sharing a replica, as a
  /// tensor-parallel group does, must be as many for every replica). It
  /// cannot tell which ranks should share a replica: over a world of dp x tp
  /// ranks, tensor-parallel peers given different replicas (rank = world
  /// rank % dp on a dp-major layout) pass. Use the constructor with the
  /// data-parallel group (or distributed_sampler on a DeviceMesh,
  /// cohort/mesh/mesh_sampler.h) there.
  DistributedSampler(size_t dataset_size, Communicator& comm,
                     DistributedSamplerOptions options = {});
  /// Over `dataset_size` samples for the ranks of `comm` (every rank that
  /// reads data), `data_parallel` being this rank's data-parallel group:
  /// num_replicas and rank are its size and rank unless `options` sets
  /// them. Collective over `comm` with the checks above, and in the same
  /// all-gather that the ranks at one rank of their data-parallel groups
  /// (a mesh's ranks that differ only off the data-parallel dimension: a
  /// tensor-parallel group, a pipeline, a context-parallel group) ask for
  /// one replica and the ranks at different ones for different replicas;
  /// otherwise InvalidArgument on every rank naming each data-parallel rank
  /// whose ranks ask for several replicas (with those ranks) and each
  /// replica asked for at several. Neither communicator is kept.
  DistributedSampler(size_t dataset_size, Communicator& comm, const Communicator& data_parallel,
                     DistributedSamplerOptions options = {});
  /// Over `dataset_size` samples; `options` must set num_replicas and rank.
  /// Checks nothing across ranks: each rank's settings are taken as given.
  DistributedSampler(size_t dataset_size, DistributedSamplerOptions options);

  /// The copy shares this sampler's epoch (a copy, not a move, so that a
  /// sampler handed to the loader with std::move keeps its epoch too).
  DistributedSampler(const DistributedSampler&) = default;
  /// Shares `other`'s epoch from now on.
  DistributedSampler& operator=(const DistributedSampler&) = default;
  ~DistributedSampler() override = default;

  /// Sets the epoch of this sampler and of every copy; it takes effect at
  /// each one's next reset() (a loader's next epoch). Not compared across
  /// ranks (see the file comment): set the same epoch on every rank.
  void set_epoch(int64_t epoch);
  /// The epoch set last (0 at first).
  int64_t epoch() const;

  /// The replicas it deals to.
  int num_replicas() const { return num_replicas_; }
  /// The replica whose indices it deals.
  int rank() const { return rank_; }
  /// The number of samples it deals from (the dataset's size).
  size_t dataset_size() const { return size_; }
  /// The permutation's seed.
  uint64_t seed() const { return seed_; }
  /// Whether each epoch permutes the dataset.
  bool shuffle() const { return shuffle_; }
  /// Whether the tail that does not divide evenly is dropped (or padded).
  bool drop_last() const { return drop_last_; }
  /// The samples this rank gets per epoch (PyTorch's len(sampler)).
  size_t num_samples() const;
  /// num_samples() times num_replicas: the padded or cut epoch.
  size_t total_size() const;
  /// This rank's indices for the current epoch, in order.
  std::vector<size_t> indices() const;

  /// Draws this rank's indices for the current epoch and starts over;
  /// `new_size`: the dataset's new size.
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  /// The next up to `batch_size` indices; none when the epoch is done.
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  /// Saves the epoch, this copy's position in it and the settings that
  /// decide the order (dataset size, num_replicas, seed, shuffle,
  /// drop_last). The position is this copy's own: a data loader's copy
  /// advances apart from the caller's (ahead of what was consumed, as it
  /// prefetches), so saving the caller's copy records the epoch's start.
  /// To resume in the middle of an epoch, use SampledDataSource under the
  /// Trainer (which counts the batches taken) or skip what was consumed.
  void save(torch::serialize::OutputArchive& archive) const override;
  /// Restores what save() wrote (and sets the shared epoch). Throws
  /// InvalidArgument when it was saved with other settings.
  void load(torch::serialize::InputArchive& archive) override;

 private:
  std::vector<std::pair<std::string, int64_t>> settings() const;
  size_t size_;
  int num_replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  std::shared_ptr<std::atomic<int64_t>> epoch_;
  std::vector<size_t> indices_;  ///< this rank's, drawn by the last reset()
  size_t next_ = 0;              ///< the first of indices_ not handed out
};

}  // namespace cohort::data
