// defines: Box, ChunkMeta, TensorMeta, Metadata: what a distributed
// checkpoint's metadata file says (after torch.distributed.checkpoint's
// Metadata), and the box arithmetic that saving and resharding share.
//
// A checkpoint is a folder: one data file per rank that wrote anything
// ("__<rank>_0.distcp") and ".metadata", written by rank 0 last. For every
// logical tensor (fully qualified name, global shape, dtype) the metadata
// lists its chunks: each an N-d box of the global tensor (offsets and
// lengths per dim), stored row-major at a byte offset of one data file,
// with a crc32 per block of kBlockBytes of its bytes. General boxes hold
// every layout: dim-0 shards (FSDP), flat ranges cut into boxes (ZeRO),
// column/row/vocab shards (TP), whole tensors (DDP, pipeline stages).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace cohort::dcp {

inline constexpr uint32_t kFormatVersion = 1;
/// Checksum granularity: a reader verifies (and so reads) whole blocks.
inline constexpr int64_t kBlockBytes = int64_t{1} << 20;
inline constexpr const char* kMetadataName = ".metadata";

/// A box of a tensor: offsets[d] <= index[d] < offsets[d] + lengths[d].
/// A 0-d tensor's only box has no dims.
struct Box {
  std::vector<int64_t> offsets;  ///< first index in each dim
  std::vector<int64_t> lengths;  ///< extent in each dim
  /// Elements in the box (1 for a 0-d tensor's box).
  int64_t numel() const;
  /// Same offsets and lengths.
  bool operator==(const Box& o) const { return offsets == o.offsets && lengths == o.lengths; }
};

/// The box of a whole tensor of `shape`.
Box whole(const std::vector<int64_t>& shape);
/// The intersection of two boxes of one tensor (numel 0 when disjoint).
Box intersect(const Box& a, const Box& b);
/// The flat (row-major) element range [begin, end) of a tensor of `shape`
/// as boxes, in order; each is contiguous in the tensor, so box k starts at
/// flat element begin + (sum of the earlier boxes' numel).
std::vector<Box> boxes_of_range(const std::vector<int64_t>& shape, int64_t begin, int64_t end);
/// "[0:4, 2:3]".
std::string to_string(const Box& box);
/// "[4, 3]".
std::string shape_string(const std::vector<int64_t>& shape);

/// One stored chunk.
struct ChunkMeta {
  Box box;                      ///< the part of the tensor it holds
  int file = 0;                 ///< index into Metadata::files
  int64_t byte_offset = 0;      ///< in that file
  std::vector<uint32_t> crc32;  ///< one per kBlockBytes block of the chunk's bytes
};

/// One logical tensor in the metadata.
struct TensorMeta {
  std::string fqn;                     ///< "model.<name>" or "optim.<name>.<state>"
  std::vector<int64_t> shape;          ///< the global shape
  torch::Dtype dtype = torch::kFloat;  ///< as stored and loaded
  std::vector<ChunkMeta> chunks;       ///< together they cover the tensor
};

/// One data file of the checkpoint.
struct FileMeta {
  std::string name;   ///< relative to the checkpoint folder
  int64_t bytes = 0;  ///< its size: a shorter file is truncated
};

/// The contents of `.metadata`: the files and every tensor's chunks.
struct Metadata {
  std::vector<FileMeta> files;      ///< one per rank, "__<rank>_0.distcp"
  std::vector<TensorMeta> tensors;  ///< sorted by fqn
  /// The model's submodule names, parameterless ones included (StateDict::modules).
  std::vector<std::string> modules;
  /// The tensor named `fqn`, or nullptr.
  const TensorMeta* find(const std::string& fqn) const;
};

/// "float32", ... (the names torch uses); throws Unsupported for others.
std::string dtype_name(torch::Dtype dtype);
torch::Dtype dtype_from_name(const std::string& name);

/// "" when the chunks of `t` tile its shape exactly: each inside the tensor,
/// no two sharing an element, every element in one. Otherwise what is wrong,
/// naming the chunks ("the chunks [0:4, 0:5] and [3:7, 0:5] overlap").
/// Saving checks what it writes with it, reading what it reads.
std::string tiling_error(const TensorMeta& t);

std::string metadata_to_json(const Metadata& meta);
/// Throws CheckpointError naming `source` and the tensor when the text is not
/// metadata, or describes what no checkpoint can hold: a negative extent, a
/// shape whose bytes overflow, a chunk outside its file's bytes, chunks that
/// do not tile their tensor (tiling_error).
Metadata metadata_from_json(const std::string& text, const std::string& source);

}  // namespace cohort::dcp
