// defines: DeviceMesh, the ranks of a communicator laid out as a grid of
// named dimensions, each with its own group communicator, and
// init_device_mesh, which builds one.
//
// Ranks are row-major, the last dimension fastest: for sizes (s_0 .. s_n-1)
// the rank at coordinates (c_0 .. c_n-1) is
//
//   rank = (..((c_0 * s_1 + c_1) * s_2 + c_2) ..) * s_n-1 + c_n-1,
//
// so the last dimension's groups are consecutive ranks (on a cluster: one
// node, where TP's per-layer all-reduces are cheapest, Megatron-LM's order).
//
//   auto mesh = cohort::init_device_mesh(world, {2, 2, 2}, {"pp", "dp", "tp"});
//   mesh["tp"].process_group()->all_reduce(partial);
//   auto dp_cp = mesh[{"dp", "cp"}];  // one group over both dimensions
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

/// A grid of named dimensions over the ranks of a communicator (file
/// comment). A cheap value: copies and sub-meshes share the groups.
///
/// Groups: init_device_mesh creates one communicator per dimension, in
/// dimension order, on every rank; `mesh[{names...}]` of two or more
/// dimensions creates that combination's group the first time it is asked
/// for (cached after), which is collective over the whole mesh, like
/// init_device_mesh itself. Its ranks first agree on which dimensions were
/// asked for, so ranks that ask in different orders get an InvalidArgument,
/// never groups of mismatched ranks.
class DeviceMesh {
 public:
  /// A 1-D mesh whose one dimension, `name`, is `group` itself (no
  /// collective): for a mode that takes a mesh when all one has is a group.
  static DeviceMesh from_group(std::shared_ptr<Communicator> group, std::string name);

  /// The 1-D sub-mesh of dimension `name`: this rank's group along it.
  /// InvalidArgument naming the mesh's dimensions when there is none.
  DeviceMesh operator[](const std::string& name) const;
  /// The sub-mesh of `names` (in the mesh's order, each once): its
  /// process_group() spans those dimensions, ranked row-major over them
  /// (flattened). Collective over the whole mesh the first time (class
  /// comment).
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  /// mesh[{"dp", "cp"}]: as the vector overload (a braced pair of literals
  /// would otherwise also read as std::string's iterator-pair constructor).
  DeviceMesh operator[](std::initializer_list<std::string> names) const {
    return (*this)[std::vector<std::string>(names)];
  }

  /// This rank's group over all of this mesh's dimensions, ranked row-major
  /// (the world for the whole mesh).
  const std::shared_ptr<Communicator>& process_group() const { return group_; }

  int ndim() const { return static_cast<int>(dims_.size()); }  ///< number of dimensions
  /// The dimensions' names, in order.
  std::vector<std::string> dim_names() const;
  /// The dimensions' sizes, in order.
  std::vector<int> shape() const;
  /// The number of ranks: the product of the sizes.
  int size() const;
  /// The size of dimension `name` (InvalidArgument when there is none).
  int size(const std::string& name) const;
  /// This rank's coordinate along dimension `name` (InvalidArgument when
  /// there is none).
  int local_rank(const std::string& name) const;
  /// This rank's coordinates, one per dimension.
  std::vector<int> coordinate() const;
  /// This rank's rank in process_group(): its coordinates read row-major.
  int rank() const;
  /// The ranks of process_group(), as ranks of the communicator the whole
  /// mesh was built over, in row-major order.
  std::vector<int> group_ranks() const;
  /// "pp=2 dp=1 tp=2", for messages.
  std::string to_string() const;

 private:
  struct Root;
  DeviceMesh(std::shared_ptr<Root> root, std::vector<int> dims);
  friend DeviceMesh init_device_mesh(std::shared_ptr<Communicator>, std::vector<int>,
                                     std::vector<std::string>);

  int dim_index(const std::string& name) const;  // index into root_'s dimensions

  std::shared_ptr<Root> root_;
  std::vector<int> dims_;  // the root's dimensions this mesh spans, ascending
  std::shared_ptr<Communicator> group_;
};

/// Builds a mesh of `shape` named `names` over `world`; collective over it.
/// The ranks agree on shape and names first (one all-gather): ranks that
/// passed different ones all get an InvalidArgument naming each rank's. Then
/// InvalidArgument on every rank when the sizes and names differ in number, a
/// size is below 1, their product is not world's size, or a name is empty or
/// repeated.
DeviceMesh init_device_mesh(std::shared_ptr<Communicator> world, std::vector<int> shape,
                            std::vector<std::string> names);

/// The group of `mesh`, for a mode that runs along one dimension (`dim`:
/// the name the message suggests). InvalidArgument "`who` on rank R: the mesh
/// must be 1-D (mesh["dim"]), got ..." when the mesh has more dimensions.
std::shared_ptr<Communicator> one_dimension_group(const DeviceMesh& mesh, const std::string& who,
                                                  const std::string& dim);

}  // namespace cohort
