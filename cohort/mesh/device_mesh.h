// defines: MeshShape, DeviceMesh, the 3-D (data, pipeline, tensor) layout of
// the ranks and one communicator per group of each dimension.
//
// Rank order as Megatron-LM's default: tensor parallel fastest, then data
// parallel, then pipeline parallel,
//
//   rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank,
//
// so a TP group is tp consecutive ranks (on a real cluster: one node, where
// the all-reduces of every layer are cheapest).
//
//   auto mesh = cohort::DeviceMesh(world, {/*dp=*/2, /*pp=*/2, /*tp=*/2});
//   mesh.tp_group()->all_reduce(partial);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort {

/// The sizes of the three dimensions; their product is the world size.
struct MeshShape {
  int dp = 1;  ///< data parallel size: replicas of the model
  int pp = 1;  ///< pipeline parallel size: stages of one replica
  int tp = 1;  ///< tensor parallel size: shards of each layer

  /// dp * pp * tp, in 64 bits (a product of three ints can pass 2^31 and
  /// even 2^63: beyond INT64_MAX it saturates there).
  int64_t world_size() const;
  /// "dp=2 pp=1 tp=2", for messages.
  std::string to_string() const;
};

/// Where one rank sits in the mesh.
struct MeshCoord {
  int dp_rank = 0;  ///< index among the data-parallel replicas
  int pp_rank = 0;  ///< pipeline stage
  int tp_rank = 0;  ///< tensor-parallel shard
};

/// The ranks of the mesh and this rank's group communicators. Built
/// collectively: every rank of `world` constructs it with the same shape
/// (checked: one all-gather of the shapes before the groups are built).
class DeviceMesh {
 public:
  /// Splits `world` into the TP, PP, DP and embedding groups. Throws
  /// InvalidArgument on every rank when the ranks passed different shapes
  /// (naming each rank's), a size is below 1 or the product is not the world
  /// size.
  DeviceMesh(std::shared_ptr<Communicator> world, MeshShape shape);

  /// The rank at `coord` (the closed formula above).
  static int rank_of(const MeshShape& shape, const MeshCoord& coord);
  /// The coordinates of `rank`.
  static MeshCoord coord_of(const MeshShape& shape, int rank);
  /// Every TP group of the mesh, each in TP-rank order.
  static std::vector<std::vector<int>> tp_groups(const MeshShape& shape);
  /// Every DP group, each in DP-rank order.
  static std::vector<std::vector<int>> dp_groups(const MeshShape& shape);
  /// Every PP group, each in stage order.
  static std::vector<std::vector<int>> pp_groups(const MeshShape& shape);
  /// Every embedding group: the first and the last stage of each PP group
  /// (one rank when pp == 1).
  static std::vector<std::vector<int>> embedding_groups(const MeshShape& shape);

  const MeshShape& shape() const { return shape_; }  ///< the sizes
  const MeshCoord& coord() const { return coord_; }  ///< this rank's place
  int rank() const { return world_->rank(); }        ///< rank in the world
  int tp_rank() const { return coord_.tp_rank; }     ///< rank in the TP group
  int pp_rank() const { return coord_.pp_rank; }     ///< stage
  int dp_rank() const { return coord_.dp_rank; }     ///< rank in the DP group
  int tp_size() const { return shape_.tp; }          ///< TP group size
  int pp_size() const { return shape_.pp; }          ///< number of stages
  int dp_size() const { return shape_.dp; }          ///< DP group size
  /// True on the first pipeline stage (holds the input embedding).
  bool is_pp_first() const { return coord_.pp_rank == 0; }
  /// True on the last pipeline stage (holds the output layer and the loss).
  bool is_pp_last() const { return coord_.pp_rank == shape_.pp - 1; }
  /// True on ranks of the embedding group (first or last stage).
  bool in_embedding_group() const { return embedding_group_ != nullptr; }

  /// World ranks of this rank's TP group, in TP-rank order.
  const std::vector<int>& tp_ranks() const { return tp_ranks_; }
  /// World ranks of this rank's PP group, in stage order.
  const std::vector<int>& pp_ranks() const { return pp_ranks_; }
  /// World ranks of this rank's DP group, in DP-rank order.
  const std::vector<int>& dp_ranks() const { return dp_ranks_; }
  /// World ranks of this rank's embedding group (empty when not a member).
  const std::vector<int>& embedding_ranks() const { return embedding_ranks_; }

  /// The whole world.
  const std::shared_ptr<Communicator>& world() const { return world_; }
  /// This rank's TP group (ranked by tp_rank).
  const std::shared_ptr<Communicator>& tp_group() const { return tp_group_; }
  /// This rank's PP group (ranked by stage).
  const std::shared_ptr<Communicator>& pp_group() const { return pp_group_; }
  /// This rank's DP group (ranked by dp_rank).
  const std::shared_ptr<Communicator>& dp_group() const { return dp_group_; }
  /// The embedding group (first and last stage); nullptr on middle stages.
  const std::shared_ptr<Communicator>& embedding_group() const { return embedding_group_; }

 private:
  std::shared_ptr<Communicator> world_;
  MeshShape shape_;
  MeshCoord coord_;
  std::vector<int> tp_ranks_, pp_ranks_, dp_ranks_, embedding_ranks_;
  std::shared_ptr<Communicator> tp_group_, pp_group_, dp_group_, embedding_group_;
};

}  // namespace cohort
