// defines: agree_on_samples, the Trainer's check at each epoch's start that
// the ranks its layout pairs up (TrainerLayout::same_samples_groups,
// ::same_inputs_groups and ::sequence_split_groups) drew the same first
// micro-batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
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

/// Throws InvalidArgument (beginning with `who`) unless `shards` (each
/// rank's DataSource::shard(), gathered over the trainer's group) deal
/// every share of the data-parallel group once per copy: each world
/// size / `copies` (TrainerLayout::ranks_per_sample), each rank in
/// [0, that) `copies` times. Nothing when a rank's source does not say.
/// The same on every rank that passes the same shards.
void check_data_shards(const std::vector<DataShard>& shards, int copies, const std::string& who);

}  // namespace cohort
