// defines: NamedTensors, save_safetensors, SafetensorsFile, load_safetensors:
// Hugging Face's safetensors format, written and read.
//
// A file is an 8-byte little-endian header length n, n bytes of JSON, then
// the data: for each tensor {"dtype": "F32", "shape": [...],
// "data_offsets": [begin, end]} (offsets into the data, row-major
// little-endian values), and an optional "__metadata__" of strings. Above
// a size (SafetensorsOptions::max_shard_bytes) the tensors are spread over
// "<stem>-00001-of-0000N.safetensors" files with an index
// "<stem>.safetensors.index.json" ({"metadata": {"total_size": bytes},
// "weight_map": {name: file}}), as transformers' save_pretrained writes.
//
// Reading checks the whole header before it reads data: a sane length,
// known dtypes, non-negative shapes whose bytes fit in 2^62, offsets inside
// the data whose length is dtype size x elements, no two tensors sharing a
// byte. A bad file is a CheckpointError naming the file and the tensor, and
// no allocation is larger than the file. Tensors are read by pread of just
// their bytes (read_box: just a box's), so each rank of a sharded model
// reads only its shard.
#pragma once

#include <c10/util/Exception.h>  // torch/ordered_dict.h uses TORCH_CHECK without it
#include <torch/ordered_dict.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "cohort/dcp/metadata.h"

namespace cohort::dcp {

/// Tensors by name, in order (as Module::named_parameters gives them).
using NamedTensors = torch::OrderedDict<std::string, torch::Tensor>;

/// How save_safetensors writes.
struct SafetensorsOptions {
  /// The header's "__metadata__" (e.g. {"format": "pt"}, which transformers
  /// expects); empty: none.
  std::map<std::string, std::string> metadata;
  /// 0: one file. Otherwise tensors go, in order, into shards of at most
  /// this many data bytes (a larger tensor gets a shard of its own), with
  /// an index, whenever they do not all fit in one.
  int64_t max_shard_bytes = 0;
};

/// "F32", ... (the safetensors names) for the dtypes checkpoints hold;
/// throws Unsupported for others.
std::string safetensors_dtype_name(torch::Dtype dtype);

/// Writes `tensors` (CPU or not, contiguous or not: written as their
/// values) to `path` (e.g. "model.safetensors"), each file atomically.
/// Sharded: the shards beside it and `path` + ".index.json". Returns the
/// files written, the index last. What an earlier save under `path` left
/// that this one does not replace (its index and shards, and its single
/// file when this save is sharded) is removed first: a reader would take
/// the old weights from it (transformers reads `path` before an index). A
/// file that cannot be removed is a CheckpointError naming it.
std::vector<std::string> save_safetensors(const NamedTensors& tensors, const std::string& path,
                                          const SafetensorsOptions& options = {});

/// One tensor of a safetensors file (or of an index's shards).
struct SafetensorsEntry {
  std::string name;            ///< its key in the header
  torch::Dtype dtype;          ///< from the header's dtype
  std::vector<int64_t> shape;  ///< from the header's shape
  std::string file;            ///< the file holding it
  int64_t offset = 0;          ///< its first byte in that file
};

/// A safetensors file, or an index and its shards, whose headers have been
/// read and checked; tensors are read on demand.
class SafetensorsFile {
 public:
  /// `path`: a .safetensors file, or an index (a name ending in ".json").
  /// Throws CheckpointError naming the file (and tensor) when a header is bad.
  explicit SafetensorsFile(const std::string& path);

  /// Every tensor, in the order of the header (of the index's weight map).
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  /// The tensor named `name`, or nullptr.
  const SafetensorsEntry* find(const std::string& name) const;
  /// The "__metadata__" of the file (of the first shard).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  /// The whole tensor `name`. Throws CheckpointError when it is not there or
  /// cannot be read.
  torch::Tensor read(const std::string& name) const;
  /// The part `box` of tensor `name` (a box of its shape), reading only its
  /// bytes: one pread per contiguous run (a dim-0 range of rows is one).
  torch::Tensor read_box(const std::string& name, const Box& box) const;

 private:
  void read_header(const std::string& file);

  std::string path_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

/// Every tensor of a safetensors file or index, in order.
NamedTensors load_safetensors(const std::string& path);

}  // namespace cohort::dcp
