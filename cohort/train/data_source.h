// defines: DataSource, what the trainer reads micro-batches from.
//
// Batches are addressed by (epoch, index), not drawn from an iterator: the
// position is two integers, so a checkpoint can store it and a resumed run
// continues with exactly the batch the interrupted one would have read.
#pragma once

#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <string>

namespace cohort {

/// Which share of the data a source deals: its data-parallel rank, the
/// number of shares (world 0: the source does not say) and the size of the
/// dataset it deals from (-1: the source does not say).
struct DataShard {
  int rank = 0;          ///< this source's share, 0 <= rank < world
  int world = 0;         ///< shares of the data; 0: unknown
  int64_t samples = -1;  ///< the dataset's samples, shared by every rank; -1: unknown
};

/// The Trainer's input: micro-batches of this rank's shard of the data, epoch by epoch.
class DataSource {
 public:
  virtual ~DataSource() = default;
  /// Prepares `epoch` (e.g. reshuffles). Same epoch, same order.
  virtual void set_epoch(int64_t epoch) = 0;
  /// Micro-batches this rank has in the current epoch; must be the same on
  /// every rank (all ranks step together; Trainer::fit checks it).
  virtual int64_t num_batches() const = 0;
  /// Micro-batch `index` (0 <= index < num_batches()) of the current epoch. May be called more
  /// than once for the same index: fit() also reads micro-batch 0 outside the training order (to
  /// check that the ranks that must draw the same samples do, and on resume without a global
  /// order to count the global batch), so it must give the same samples each time. Draws from
  /// LibTorch's default generators in those reads are undone (DefaultRngStatesKept), so
  /// augmentation drawn from them continues as in an uninterrupted run; a generator of the
  /// source's own that batch() advances is not: seed such a one from (epoch, index).
  virtual torch::data::Example<> batch(int64_t index) = 0;
  /// g > 0 when the epoch has one global sample order that does not depend on the world size and
  /// micro-batch `index` of all ranks together is its samples [index * g, (index + 1) * g): then
  /// a checkpoint resumes at another world size, continuing that order (Trainer::resume). 0 when
  /// the source has no such order; a checkpoint then resumes mid-epoch at its own world size and
  /// data-parallel size only.
  virtual int64_t global_micro_batch() const { return 0; }
  /// With a global order: whether a resume in the middle of an epoch over a dataset of another
  /// size continues after the checkpoint's count of samples in the new dataset's order (true:
  /// TensorDataSource, as torchdata's StatefulDistributedSampler) or is refused (false:
  /// SampledDataSource). A source without a global order is refused there either way.
  virtual bool resumes_over_another_dataset() const { return true; }
  /// The dataset indices of micro-batch `index`'s samples, in order (int64,
  /// one per sample), or an undefined tensor when the source has none.
  /// fit() compares them at each epoch's start among the ranks that must
  /// draw the same samples (TrainerLayout::same_samples_groups). The ranks
  /// of a context-parallel group each hold other positions of the same
  /// sequences, so only these tell whether they drew the same samples: a
  /// source trained under context parallelism (cp > 1) must give them.
  virtual torch::Tensor sample_indices(int64_t /*index*/) { return {}; }
  /// The share of the data this source deals (TensorDataSource's rank and
  /// world size), or world 0 when it does not say. fit() checks at each
  /// epoch's start that the ranks' shares are those of the data-parallel
  /// group: every share once for each of its copies (a pipeline's or TP
  /// group's ranks share one), so that no two replicas train on the same
  /// samples.
  virtual DataShard shard() const { return {}; }
  /// What decides each epoch's sample order besides the epoch, the dataset's size and the shares
  /// (a sampler's seed, whether it shuffles), as text; "" when the source does not say. fit()
  /// compares it across ranks at each epoch's start (ranks that deal from different orders train
  /// some samples twice and others never), and a checkpoint records it: a resume in the middle of
  /// an epoch under another one is refused, since the position counts that epoch's old order.
  virtual std::string order_settings() const { return ""; }
};

}  // namespace cohort
