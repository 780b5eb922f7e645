// defines: read_idx_gz, which reads a gzip-compressed IDX file (the MNIST
// format: big-endian magic with the element type and rank, then the
// dimensions, then the data) into a uint8 tensor with zlib's gzread.
#pragma once

#include <torch/types.h>

#include <string>

namespace fashion_mnist {

// Throws cohort::InvalidArgument naming the file: missing, not gzip/IDX,
// not unsigned-byte data, or shorter than its dimensions say.
torch::Tensor read_idx_gz(const std::string& path);

}  // namespace fashion_mnist
