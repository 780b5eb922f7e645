#include "cohort/mesh/mesh_sampler.h"

namespace cohort {

data::DistributedSampler distributed_sampler(size_t dataset_size, const DeviceMesh& mesh,
                                             const std::string& dim,
                                             data::DistributedSamplerOptions options) {
  // mesh[dim] throws InvalidArgument naming the mesh's dimensions when it
  // has none of that name.
  return data::DistributedSampler(dataset_size, *mesh.process_group(), *mesh[dim].process_group(),
                                  options);
}

}  // namespace cohort
