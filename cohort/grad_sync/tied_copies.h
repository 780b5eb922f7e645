// defines: TiedCopies, one weight of which several ranks of a group hold a
// copy each (DeepSpeed's TiedLayerSpec, Megatron's embedding group: a
// pipeline's input embedding and output layer on its first and last stage).
//
// Ranks are processes and cannot share a tensor, so each holder keeps a copy
// of its own, and the copies stay one weight only when they start equal and
// every optimizer step moves them by the same gradient: the sum of every
// copy's (each copy's backward sees only its own stage's use of the weight).
// Construction makes them equal (the original's value, broadcast);
// sum_gradients() adds the gradients up on every holder. The pipeline
// runtime (declared ties) and the mesh's GradientSynchronizer (the GPT
// example's embedding) both keep their tied weights through it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/core/types.h"

namespace cohort {

class Communicator;

/// One weight held as a copy on each of several ranks of a group (file comment).
class TiedCopies {
 public:
  /// Collective over `group`, on every rank, holder or not: one all-gather
  /// of a few words, one split, one broadcast among the holders. `copies`:
  /// this rank's copies (several when two of its stages use the weight
  /// through different tensors; none on a rank without the weight).
  /// Copies of different shapes or dtypes, or an undefined one, are an
  /// InvalidArgument on every rank of `group` naming `name`, the two ranks
  /// and what each holds (`who` starts the message). The original is the
  /// first copy of the holder with the lowest `order` (a pipeline passes its
  /// lowest stage holding the weight; -1: this rank's rank in `group`), the
  /// lowest rank among equal ones; then every copy holds its value.
  TiedCopies(Communicator& group, std::vector<torch::Tensor> copies, const std::string& name,
             const std::string& who, int64_t order = -1);
  ~TiedCopies();

  /// Sums the copies' gradients over the holders (this rank's copies first),
  /// so that each copy's .grad is the whole weight's gradient. A copy
  /// without a gradient takes part as zeros; when no copy anywhere has one
  /// (unused, or frozen) they stay undefined, as in one process. Collective
  /// over group(); nothing on a rank without copies. Returns the bytes
  /// all-reduced.
  int64_t sum_gradients(const AllReduceOptions& options = {});

  /// This rank's copies.
  const std::vector<torch::Tensor>& copies() const { return copies_; }
  /// The ranks holding a copy (null on a rank without one).
  const std::shared_ptr<Communicator>& group() const { return group_; }
  /// Whether this rank holds the original, the copy that stands for the
  /// weight: the one a norm counts and a checkpoint writes; the others are
  /// duplicates().
  bool holds_original() const { return original_here_; }
  /// This rank's copies but the original: a norm over every rank's
  /// parameters must leave them out, or it counts the weight more than once.
  std::vector<torch::Tensor> duplicates() const;
  /// The rank in the constructor's group holding the original.
  int original_rank() const { return original_rank_; }

 private:
  std::vector<torch::Tensor> copies_;
  std::shared_ptr<Communicator> group_;
  bool original_here_ = false;
  int original_rank_ = -1;
};

}  // namespace cohort
