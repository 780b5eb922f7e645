// defines: Split (images and labels of one Fashion-MNIST split) and
// load_split, reading Debian's dataset-fashion-mnist files.
#pragma once

#include <torch/types.h>

#include <string>

namespace fashion_mnist {

// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr const char* kDebianDataDir = "/usr/share/datasets/fashion-mnist";

// Training-set pixel statistics (after scaling to [0, 1]), as in the
// PyTorch reference script.
inline constexpr double kMean = 0.2860;
inline constexpr double kStd = 0.3530;

struct Split {
  torch::Tensor images;  // [n, 1, 28, 28] float32, normalized
  torch::Tensor labels;  // [n] int64 in 0..9
};

// split: "train" or "t10k". Throws cohort::InvalidArgument naming the
// missing or broken file.
Split load_split(const std::string& dir, const std::string& split);

}  // namespace fashion_mnist
