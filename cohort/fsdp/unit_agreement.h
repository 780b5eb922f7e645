// defines: the cross-rank agreements of fully sharded units, each one
// all-gather of a few fixed-size words, so that ranks that disagree meet a
// clear error on every rank instead of exchanging buffers of other sizes
// (an engine's abort, a truncated message, a hang):
//
//   agree_unit      at each unit's construction, before anything is sharded:
//                   the wrapped module, its own parameters (count, elements,
//                   dtypes and shapes), reshard_after_forward, the mixed
//                   precision policy, and a digest of every unit inside it
//                   (so the root's covers the whole tree: count, order,
//                   shapes, options); a rank that refuses to wrap it (a
//                   parameter tied to another unit) is an error everywhere,
//                   and so are ranks whose parameters hold different
//                   tensor-parallel ranks' parts.
//   ScheduleCheck   before each collective of the root's schedule: which
//                   collective, of which unit, in which forward, and a digest
//                   of the settings that shape the schedule (each unit's
//                   reshard_after_forward, each parameter's requires_grad,
//                   gradient sync). Ranks whose forwards ran other units
//                   (rank-dependent control flow) are named, with the unit.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/fsdp/mixed_precision.h"
#include "cohort/fsdp/reshard_after_forward.h"

namespace cohort::fsdp {

/// What every rank must agree on about one unit at its construction.
struct UnitRecord {
  /// The wrapped module's name (its first 40 characters are compared).
  std::string module;
  /// Units in its tree, itself included.
  int64_t units = 1;
  /// Digest of the units inside it, in pre-order (their digest()).
  uint64_t inner = 0;
  /// Its own parameters (those no inner unit holds).
  int64_t params = 0;
  /// Their elements.
  int64_t numel = 0;
  /// A digest of their dtypes and shapes, in order.
  uint64_t shapes = 0;
  /// What the unit frees after forward.
  ReshardAfterForward reshard_after_forward;
  /// Its mixed precision policy.
  MixedPrecisionPolicy policy;
  /// A digest of the tensor-parallel parts its own parameters hold
  /// (grad_sync/parameter_check.h's tensor_parallel_words).
  uint64_t tp_parts = 0;
  /// Non-empty: why this rank refuses to wrap the unit.
  std::string refusal;
  /// Its own parameters (not compared: they find the parameter whose TP
  /// parts differ).
  std::vector<torch::Tensor> own_params;
  /// Their names, for that message.
  std::vector<std::string> own_names;

  /// A digest of every field but `refusal` (a parent's `inner` combines them).
  uint64_t digest() const;
};

/// Collective over `comm` (one all-gather of 18 words per rank; none at
/// world size 1). Throws on every rank when any rank refused (InvalidArgument
/// with its own reason on the ranks that refused; MismatchError naming them on
/// the others) or when the records differ (MismatchError naming `who`, each
/// field that differs and each group of ranks with its value). With records
/// that agree but for their TP parts, throws InvalidArgument on every rank
/// (refuse_mixed_tensor_parallel_parts, a second all-gather only then): the
/// mesh crosses the TP group, and sharding over it would mix the TP ranks'
/// parts of a parameter.
void agree_unit(Communicator& comm, const UnitRecord& mine, const std::string& who);

/// Collective over `comm` (one all-gather of one word per rank; none at
/// world size 1): throws InvalidArgument on every rank when any rank passed a
/// non-empty `refusal` (its own reason on the ranks that refused; the others
/// name them). Nothing is thrown when no rank refuses.
void agree_refusal(Communicator& comm, const std::string& refusal, const std::string& who);

/// ScheduleCheck::before's unit for a collective of no unit.
inline constexpr size_t kNoUnit = static_cast<size_t>(-1);

/// The collectives of a root's schedule (ScheduleCheck::before).
enum class ScheduleStep : int64_t {
  kForwardGather = 1,  // a unit's all-gather for its forward (or a prefetch)
  kBackwardGather,     // a unit's all-gather for its backward
  kReduceScatter,      // a unit's gradients
  kGradientPresence,   // the end of backward: which parameters had gradients
  kBuffers,            // rank 0's buffers, before a training forward
  kUnshard,            // unshard() of every unit
};

/// The check before each collective of one root's schedule (see the file
/// comment).
class ScheduleCheck {
 public:
  /// `units`: each unit's name in errors, in the schedule's order; `owners`:
  /// what each settings flag is, in errors (set_settings).
  ScheduleCheck(std::shared_ptr<Communicator> comm, std::vector<std::string> units,
                std::vector<std::string> owners);

  /// The settings that shape the schedule, one flag (0 or 1) per owner: per
  /// unit its reshard_after_forward, then per parameter its requires_grad.
  void set_settings(std::vector<int64_t> flags);
  /// Per unit (in the schedule's order) whether its backward
  /// reduce-scatters (1) or keeps its full gradients (0).
  void set_sync(std::vector<int64_t> per_unit);
  /// A new forward of the root begins; `kept_gathered`: with units an
  /// earlier training forward left gathered (its output lives, no backward
  /// ran through it), which a mismatch names when the ranks differ in it.
  void next_pass(bool kept_gathered) {
    ++pass_;
    kept_gathered_ = kept_gathered;
  }

  /// Collective (one all-gather of 18 words per rank; none at world size 1):
  /// every rank is about to issue `step` for unit `unit` (kNoUnit: none). Throws MismatchError on
  /// every rank otherwise, naming each group of ranks and what it was about to do. A non-empty
  /// `refusal` (this rank cannot go on: a parameter's storage was replaced) is an
  /// InvalidArgument on every rank, with its reason on the ranks that refused.
  void before(ScheduleStep step, size_t unit, const std::string& refusal = {});

 private:
  std::string describe(const int64_t* header) const;
  // The settings differ: names the first flag that differs (one more
  // all-gather, of the flags; every rank takes this path together).
  std::string describe_settings();
  // The sync settings differ: names the first unit whose setting differs
  // (one more all-gather, as describe_settings).
  std::string describe_sync();

  std::shared_ptr<Communicator> comm_;
  std::vector<std::string> units_;
  std::vector<int64_t> flags_;
  std::vector<std::string> owner_;
  uint64_t settings_ = 0;
  std::vector<int64_t> sync_flags_;
  uint64_t sync_ = 0;  // their digest
  int64_t pass_ = 0;
  bool kept_gathered_ = false;
};

}  // namespace cohort::fsdp
