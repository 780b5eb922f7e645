// defines: FlatPartition, the balanced partition of a model's parameters,
// laid end to end in one flat buffer, over the ranks of a communicator.
//
// The flat buffer is cut into buckets of at most `bucket_elements` elements
// (a multiple of the world size); the last bucket is padded with zeros to a
// multiple of the world size. Rank r owns chunk r of every bucket:
//
//   flat:    | bucket 0                  | bucket 1 (last)      |pad|
//   chunks:  | r0     | r1     | r2      | r0    | r1    | r2        |
//
// So every rank's shard has exactly padded_numel / world elements (balanced
// to the element, whatever the parameter sizes), and each bucket can be
// reduce-scattered / all-gathered with the *_tensor collectives, which need
// equal chunks. A parameter may straddle chunks and ranks: what a rank
// optimizes are its Pieces, the intersections of its chunks with parameters.
// A parameter of no elements is a piece of rank 0 (of no elements, in the
// bucket where it lies), so that one rank steps it and holds its state (a
// step count), as one process would.
#pragma once

#include <cstdint>
#include <vector>

namespace cohort {

class FlatPartition {
 public:
  /// One parameter's place in the flat buffer.
  struct Param {
    int64_t offset = 0;  ///< first element in the flat buffer
    int64_t numel = 0;
    size_t group = 0;  ///< its optimizer parameter group
  };
  /// One bucket: flat range [offset, offset + padded) of which the first
  /// `numel` elements hold parameters; chunk = padded / world.
  struct Bucket {
    int64_t offset = 0;
    int64_t numel = 0;
    int64_t padded = 0;
    int64_t chunk = 0;
    int64_t shard_offset = 0;  ///< where this bucket's chunk starts in a shard
  };
  /// The intersection of this rank's chunk of a bucket with one parameter.
  struct Piece {
    size_t param = 0;  ///< index of the parameter
    size_t bucket = 0;
    int64_t param_offset = 0;  ///< first element inside the parameter
    int64_t shard_offset = 0;  ///< first element inside this rank's shard
    int64_t numel = 0;
  };

  /// numels[i] and groups[i]: size and group of parameter i, in flat order.
  /// bucket_elements is rounded up to a multiple of world (at least world).
  FlatPartition(const std::vector<int64_t>& numels, const std::vector<size_t>& groups, int world,
                int rank, int64_t bucket_elements);

  int world() const { return world_; }
  int rank() const { return rank_; }
  int64_t numel() const { return numel_; }                // parameters' elements
  int64_t padded_numel() const { return padded_numel_; }  // flat buffer length
  int64_t shard_numel() const { return padded_numel_ / world_; }
  const std::vector<Param>& params() const { return params_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// This rank's pieces, ordered by bucket and shard offset.
  const std::vector<Piece>& pieces() const { return pieces_; }
  /// Flat offset of element 0 of this rank's chunk of bucket b.
  int64_t chunk_offset(size_t b) const { return buckets_[b].offset + rank_ * buckets_[b].chunk; }

 private:
  int world_;
  int rank_;
  int64_t numel_ = 0;
  int64_t padded_numel_ = 0;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::vector<Piece> pieces_;
};

}  // namespace cohort
