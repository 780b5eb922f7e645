// Every group is made by Communicator::split of the mesh's root communicator,
// which is collective over it and pairs the calls of the ranks in the order
// they are made. init_device_mesh therefore splits once per dimension, in
// dimension order, on every rank; a combination of dimensions is split when
// first asked for, after one all-gather that checks every rank asked for the
// same one (two ranks asking for two combinations in different orders would
// otherwise pair unrelated splits and build groups of the wrong ranks).
// Shape and names are agreed the same way before any check, so that a bad
// shape is an error on every rank, not a split whose groups do not match.
#include "cohort/mesh/device_mesh.h"

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort {

struct DeviceMesh::Root {
  std::shared_ptr<Communicator> world;
  std::vector<int> shape;
  std::vector<std::string> names;
  std::vector<int> coord;  // this rank's, one per dimension
  // By dimensions spanned. The mutex lets threads of one rank share a mesh:
  // a lookup never reads the map while another thread adds a combination.
  std::mutex mu;
  std::map<std::vector<int>, std::shared_ptr<Communicator>> groups;
};

namespace {

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string text;
  for (size_t i = 0; i < parts.size(); ++i) text += (i ? sep : "") + parts[i];
  return text;
}

std::string describe(const std::vector<int>& shape, const std::vector<std::string>& names) {
  std::vector<std::string> parts;
  if (shape.size() == names.size()) {
    for (size_t i = 0; i < shape.size(); ++i) {
      parts.push_back((names[i].empty() ? "\"\"" : names[i]) + "=" + std::to_string(shape[i]));
    }
    return shape.empty() ? "no dimensions" : join(parts, " ");
  }
  for (int s : shape) parts.push_back(std::to_string(s));
  return "sizes (" + join(parts, ", ") + ") names (" + join(names, ", ") + ")";
}

// Row-major index of `coord` over `dims`.
int row_major(const std::vector<int>& shape, const std::vector<int>& coord,
              const std::vector<int>& dims) {
  int index = 0;
  for (int d : dims) index = index * shape[static_cast<size_t>(d)] + coord[static_cast<size_t>(d)];
  return index;
}

// This rank's group over `dims` (collective over root.world).
std::shared_ptr<Communicator> split_over(const std::vector<int>& shape,
                                         const std::vector<int>& coord, Communicator& world,
                                         const std::vector<int>& dims) {
  std::vector<int> others;
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) others.push_back(d);
  }
  int size = 1;
  for (int d : dims) size *= shape[static_cast<size_t>(d)];
  const int key = row_major(shape, coord, dims);
  auto group = world.split(row_major(shape, coord, others), key);
  COHORT_CHECK(group && group->size() == size && group->rank() == key,
               "mesh group does not match its closed form");
  return group;
}

}  // namespace

DeviceMesh init_device_mesh(std::shared_ptr<Communicator> world, std::vector<int> shape,
                            std::vector<std::string> names) {
  if (!world) throw InvalidArgument("cohort: init_device_mesh: the world communicator is null");
  const std::string who = "cohort: init_device_mesh (rank " + std::to_string(world->rank()) + "): ";
  const std::string text = describe(shape, names);
  agree_text(*world, text, who, "the mesh shape");
  if (shape.empty() || shape.size() != names.size()) {
    throw InvalidArgument(who + "needs one name per size and at least one of each, got " + text);
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i].empty())
      throw InvalidArgument(who + "dimension " + std::to_string(i) + " has an empty name (" + text +
                            ")");
    if (std::count(names.begin(), names.end(), names[i]) > 1) {
      throw InvalidArgument(who + "dimension name '" + names[i] + "' is repeated (" + text + ")");
    }
    if (shape[i] < 1) throw InvalidArgument(who + "every size must be at least 1, got " + text);
  }
  // The product in 64 bits, saturating: a shape whose 32-bit product wraps to
  // the world size must be refused.
  int64_t needed = 1;
  for (int s : shape) {
    if (__builtin_mul_overflow(needed, int64_t{s}, &needed)) {
      needed = std::numeric_limits<int64_t>::max();
      break;
    }
  }
  if (needed != world->size()) {
    const bool saturated = needed == std::numeric_limits<int64_t>::max();
    throw InvalidArgument(who + text + " needs " +
                          (saturated ? "2^63 or more" : std::to_string(needed)) +
                          " ranks, the world has " + std::to_string(world->size()));
  }
  auto root = std::make_shared<DeviceMesh::Root>();
  root->world = world;
  root->shape = std::move(shape);
  root->names = std::move(names);
  for (size_t d = root->shape.size(), rest = static_cast<size_t>(world->rank()); d-- > 0;) {
    root->coord.insert(root->coord.begin(), static_cast<int>(rest % root->shape[d]));
    rest /= root->shape[d];
  }
  const int n = static_cast<int>(root->shape.size());
  std::vector<int> all;
  for (int d = 0; d < n; ++d) {
    root->groups[{d}] = split_over(root->shape, root->coord, *world, {d});
    all.push_back(d);
  }
  // Each dimension has its own communicator even when it spans the world, so
  // a mode's traffic never shares one with the world's own.
  if (n > 1) root->groups[all] = world;
  return DeviceMesh(std::move(root), std::move(all));
}

DeviceMesh DeviceMesh::from_group(std::shared_ptr<Communicator> group, std::string name) {
  if (!group || name.empty()) {
    throw InvalidArgument("cohort: DeviceMesh::from_group: needs a group and a name, got " +
                          std::string(group ? "" : "a null group") +
                          (name.empty() ? (group ? "an empty name" : " and an empty name") : ""));
  }
  auto root = std::make_shared<Root>();
  root->world = group;
  root->shape = {group->size()};
  root->names = {std::move(name)};
  root->coord = {group->rank()};
  root->groups[{0}] = std::move(group);
  return DeviceMesh(std::move(root), {0});
}

DeviceMesh::DeviceMesh(std::shared_ptr<Root> root, std::vector<int> dims)
    : root_(std::move(root)), dims_(std::move(dims)) {
  std::lock_guard<std::mutex> lock(root_->mu);
  group_ = root_->groups.at(dims_);
}

int DeviceMesh::dim_index(const std::string& name) const {
  for (int d : dims_) {
    if (root_->names[static_cast<size_t>(d)] == name) return d;
  }
  throw InvalidArgument("cohort: DeviceMesh (rank " + std::to_string(root_->world->rank()) +
                        "): no dimension '" + name + "' (the mesh has " + join(dim_names(), ", ") +
                        ")");
}

DeviceMesh DeviceMesh::operator[](const std::string& name) const {
  return DeviceMesh(root_, {dim_index(name)});
}

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& names) const {
  const std::string who = "cohort: DeviceMesh[{" + join(names, ", ") + "}] (rank " +
                          std::to_string(root_->world->rank()) + "): ";
  std::vector<int> dims;
  for (const auto& name : names) {
    const int d = dim_index(name);
    if (!dims.empty() && d <= dims.back()) {
      throw InvalidArgument(who + "names must be distinct and in the mesh's order (" +
                            join(dim_names(), ", ") + ")");
    }
    dims.push_back(d);
  }
  if (dims.empty()) throw InvalidArgument(who + "needs at least one dimension name");
  {
    std::lock_guard<std::mutex> lock(root_->mu);
    if (root_->groups.count(dims) == 0) {
      agree_text(*root_->world, join(names, ", "), who, "the dimensions asked for");
      root_->groups[dims] = split_over(root_->shape, root_->coord, *root_->world, dims);
    }
  }
  return DeviceMesh(root_, std::move(dims));
}

std::vector<std::string> DeviceMesh::dim_names() const {
  std::vector<std::string> names;
  for (int d : dims_) names.push_back(root_->names[static_cast<size_t>(d)]);
  return names;
}

std::vector<int> DeviceMesh::shape() const {
  std::vector<int> sizes;
  for (int d : dims_) sizes.push_back(root_->shape[static_cast<size_t>(d)]);
  return sizes;
}

int DeviceMesh::size() const { return group_->size(); }

int DeviceMesh::size(const std::string& name) const {
  return root_->shape[static_cast<size_t>(dim_index(name))];
}

int DeviceMesh::local_rank(const std::string& name) const {
  return root_->coord[static_cast<size_t>(dim_index(name))];
}

std::vector<int> DeviceMesh::coordinate() const {
  std::vector<int> coord;
  for (int d : dims_) coord.push_back(root_->coord[static_cast<size_t>(d)]);
  return coord;
}

int DeviceMesh::rank() const { return row_major(root_->shape, root_->coord, dims_); }

std::vector<int> DeviceMesh::group_ranks() const {
  // Walk this mesh's coordinates row-major, the other dimensions fixed at
  // this rank's.
  std::vector<int> coord = root_->coord, ranks;
  std::vector<int> every(root_->shape.size());
  for (size_t d = 0; d < every.size(); ++d) every[d] = static_cast<int>(d);
  for (int i = 0; i < size(); ++i) {
    for (size_t k = dims_.size(), rest = static_cast<size_t>(i); k-- > 0;) {
      const auto d = static_cast<size_t>(dims_[k]);
      coord[d] = static_cast<int>(rest % root_->shape[d]);
      rest /= root_->shape[d];
    }
    ranks.push_back(row_major(root_->shape, coord, every));
  }
  return ranks;
}

std::string DeviceMesh::to_string() const { return describe(shape(), dim_names()); }

std::shared_ptr<Communicator> one_dimension_group(const DeviceMesh& mesh, const std::string& who,
                                                  const std::string& dim) {
  if (mesh.ndim() != 1) {
    throw InvalidArgument(who + " on rank " + std::to_string(mesh.process_group()->rank()) +
                          ": the mesh must be 1-D (mesh[\"" + dim + "\"]), got " +
                          mesh.to_string());
  }
  return mesh.process_group();
}

}  // namespace cohort
