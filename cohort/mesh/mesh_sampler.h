// defines: distributed_sampler, a data::DistributedSampler dealt over one
// dimension of a DeviceMesh: each rank's replica is its coordinate along
// that dimension, so the ranks that differ only off it (tensor-parallel,
// pipeline, context-parallel peers) draw the same samples.
//
//   auto mesh = cohort::init_device_mesh(world, {2, 2}, {"dp", "tp"});
//   auto sampler = cohort::distributed_sampler(dataset.size().value(), mesh);
//   auto loader = torch::data::make_data_loader(dataset, sampler, batch_size);
#pragma once

#include <cstddef>
#include <string>

#include "cohort/data/distributed_sampler.h"
#include "cohort/mesh/device_mesh.h"

namespace cohort {

/// A sampler over `dataset_size` samples for every rank of `mesh`, with
/// num_replicas and rank its size and coordinate along `dim` unless
/// `options` sets them. Collective over the whole mesh (the
/// DistributedSampler constructor with the data-parallel group): the
/// ranks' settings must agree, and the ranks at one coordinate along `dim`
/// must ask for one replica and those at different coordinates for
/// different ones, else InvalidArgument on every rank naming them. `dim`
/// is one dimension; for rows dealt over several (dp x ep), pass the
/// flattened group, mesh[{"dp", "ep"}].process_group(), to that constructor.
data::DistributedSampler distributed_sampler(size_t dataset_size, const DeviceMesh& mesh,
                                             const std::string& dim = "dp",
                                             data::DistributedSamplerOptions options = {});

}  // namespace cohort
