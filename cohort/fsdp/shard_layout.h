// defines: ShardLayout, where each parameter of one FSDP unit lives when
// sharded on dim 0 across the ranks, and the two copies between the
// all-gathered buffer and the full parameters (copy_out) and between the
// full gradients and the reduce-scatter input (copy_in).
//
// Each parameter of `rows` rows (a 0-d parameter counts as one row of one
// element) is cut into world chunks of chunk = ceil(rows / world) rows;
// rank r holds rows [r * chunk, min((r + 1) * chunk, rows)), possibly none.
// A rank's flat shard is its chunk of every parameter in order, each padded
// to `chunk` rows, so every rank's flat shard has the same size and one
// all-gather (or reduce-scatter) moves the whole unit: the gathered buffer
// is rank-major, [rank 0's shard | rank 1's shard | ...]. The padding is
// zero and never reaches a parameter, a gradient or the optimizer.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace cohort::fsdp {

/// One parameter's place in its unit.
struct ParamShard {
  /// The parameter's full shape.
  std::vector<int64_t> full_sizes;
  /// Its shard's shape on this rank: local_rows rows.
  std::vector<int64_t> shard_sizes;
  /// Rows on dim 0 (1 for a 0-d parameter).
  int64_t rows = 0;
  /// Elements per row.
  int64_t row_numel = 0;
  /// Rows per rank before the cut at `rows` (ceil(rows / world)).
  int64_t chunk_rows = 0;
  /// Rows this rank holds (0 to chunk_rows).
  int64_t local_rows = 0;
  /// Offset of its padded chunk in every rank's flat shard.
  int64_t shard_offset = 0;
  /// Offset of the full parameter in the unit's unsharded buffer.
  int64_t full_offset = 0;
};

/// The dim-0 sharding of one unit's parameters (see the file comment).
struct ShardLayout {
  /// Per parameter, in the unit's order.
  std::vector<ParamShard> params;
  /// Elements of one rank's flat shard (padding included).
  int64_t shard_numel = 0;
  /// Elements of all full parameters together.
  int64_t full_numel = 0;
  /// Ranks the unit is sharded over.
  int world = 1;
  /// This rank.
  int rank = 0;
};

/// The layout of `params` (their shapes as given: full) over `world` ranks.
ShardLayout make_shard_layout(const std::vector<torch::Tensor>& params, int world, int rank);

/// Copies the rank-major all-gather output `gathered` (world * shard_numel
/// elements) into the full parameters `full` (one tensor per parameter).
void copy_out(const ShardLayout& layout, const torch::Tensor& gathered,
              const std::vector<torch::Tensor>& full);

/// Writes the full gradients `grads` (undefined: zeros) into the rank-major
/// reduce-scatter input `flat` (world * shard_numel elements), padding zero.
void copy_in(const ShardLayout& layout, const std::vector<torch::Tensor>& grads,
             torch::Tensor& flat);
/// copy_in for parameter i alone (`grad` undefined: zeros).
void copy_in_param(const ShardLayout& layout, size_t i, const torch::Tensor& grad,
                   torch::Tensor& flat);

/// This rank's rows of the full tensor `full`, as a flat shard piece of
/// chunk_rows rows, padding zero: what rank `layout.rank` holds of it.
void copy_local_rows(const ParamShard& p, int rank, const torch::Tensor& full,
                     torch::Tensor& shard_flat);

}  // namespace cohort::fsdp
