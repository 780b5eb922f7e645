// defines: agree_on_samples, the Trainer's check at each epoch's start that
// the ranks its layout pairs up (TrainerLayout::same_samples_groups,
// ::same_inputs_groups and ::sequence_split_groups) drew the same first
// micro-batch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/core/agreement.h"
#include "cohort/plan/trainer_layout.h"
#include "cohort/train/data_source.h"

namespace cohort {

/// Collective over each of `layout`'s same-samples groups and then `world`
/// (one all-gather each; none without groups): throws InvalidArgument on
/// every rank of `world` unless, in each group, every rank's first
/// micro-batch of `epoch` has the same targets (its inputs where it has
/// none) and the same sample indices where every rank's source gives them
/// (DataSource::sample_indices) and, in the same-inputs groups, the same
/// inputs. In a sequence-split group (context parallelism) the contents
/// differ by design: there the sample indices alone are compared, and a
/// source that gives none is refused. The ranks of the group that differs
/// and their digests are named on its ranks; the others name the ranks that
/// found it.
void agree_on_samples(Communicator& world, const TrainerLayout& layout, DataSource& data,
                      int64_t epoch);

/// The two words check_data_order compares for a source whose
/// DataSource::order_settings() is `order`: whether it says, and a digest.
std::vector<int64_t> order_words(const std::string& order);

/// The digest of the order settings the ranks whose sources say them
/// (order_words at word `at` of each rank's row of `all`, gathered over
/// `world`) agree on; none when no rank's says. When they say different
/// ones, throws InvalidArgument on every rank (beginning with `who`),
/// after gathering every rank's `order` to name each group (two
/// all-gathers, made by every rank alike, since all found the same):
/// replicas dealing from different orders would train on some samples
/// twice and others never.
std::optional<uint64_t> check_data_order(Communicator& world, const RankWords& all, size_t at,
                                         const std::string& order, const std::string& who);

/// Throws InvalidArgument (beginning with `who`) unless `shards` (each
/// rank's DataSource::shard(), gathered over the trainer's group) deal
/// from datasets of one size (among the ranks whose sources say) and every
/// share of the data-parallel group once per copy: each world size /
/// `copies` (TrainerLayout::ranks_per_sample), each rank in [0, that)
/// `copies` times (nothing when a rank's source does not say).
/// The same on every rank that passes the same shards.
void check_data_shards(const std::vector<DataShard>& shards, int copies, const std::string& who);

}  // namespace cohort
