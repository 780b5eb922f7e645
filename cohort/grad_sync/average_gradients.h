// defines: average_gradients, data parallelism without buckets: the
// gradients averaged after backward in one coalesced all-reduce: the one
// spelling of "average the gradients". The Trainer's AllReduceGradientSync
// (a model without DDP), a pipeline's data-parallel group and the MoE
// layer's dense and expert groups call it. reduce_gradients is the same with
// another operation: the GradientSynchronizer's sums over TP, the tied
// embedding's group and the expert replicas.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "cohort/core/types.h"

namespace cohort {

class Communicator;

/// Collective over `comm` (every rank passes the same parameters, in the
/// same order): averages the .grad of `params` in one coalesced all-reduce
/// and waits, after one small all-reduce that says which parameters have a
/// gradient on any rank (any_rank_has). A parameter that does not require
/// grad counts as having none and keeps none. One with a gradient on some
/// ranks only takes part as zeros on the others (their .grad becomes the
/// average); one with a gradient on no rank keeps an undefined .grad, so
/// that the optimizer skips it as in one process. At world size 1 (or
/// without parameters) nothing is sent and the gradients are left as they
/// are.
void average_gradients(const std::vector<torch::Tensor>& params, Communicator& comm);

/// average_gradients after a step that may have failed on some ranks
/// (`failed`: the exception that ended this rank's share, null where it
/// ran; a pipeline replica's). The first all-reduce carries each rank's
/// failure (any_rank_has_unless_failed): when some rank failed, nothing is
/// averaged, every rank drops the gradients of `params` (.grad undefined, as
/// the failed replica's pipeline did) and throws, the failing ranks their
/// own exception, the others one of its kind naming `where` and its message.
/// At world size 1 it rethrows `failed`, if any. Without parameters the
/// all-reduce still runs, for the failures alone.
void average_gradients(const std::vector<torch::Tensor>& params, Communicator& comm,
                       const std::exception_ptr& failed, const std::string& where);

/// average_gradients with the all-reduce's `options` (its operation and
/// algorithm) instead of an average. Returns the bytes of the gradients
/// reduced: those some rank has (0 at world size 1, without parameters, or
/// when no rank has one).
int64_t reduce_gradients(const std::vector<torch::Tensor>& params, Communicator& comm,
                         const AllReduceOptions& options);

}  // namespace cohort
