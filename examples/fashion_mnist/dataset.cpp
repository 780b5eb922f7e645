#include "dataset.h"

#include "cohort/core/error.h"
#include "idx_file.h"

namespace fashion_mnist {

Split load_split(const std::string& dir, const std::string& split) {
  const std::string images_path = dir + "/" + split + "-images-idx3-ubyte.gz";
  const std::string labels_path = dir + "/" + split + "-labels-idx1-ubyte.gz";
  auto images = read_idx_gz(images_path);
  auto labels = read_idx_gz(labels_path);
  if (images.dim() != 3 || images.size(1) != 28 || images.size(2) != 28) {
    throw cohort::InvalidArgument("fashion_mnist: " + images_path + ": expected n x 28 x 28 images");
  }
  if (labels.dim() != 1 || labels.size(0) != images.size(0)) {
    throw cohort::InvalidArgument("fashion_mnist: " + labels_path + ": " +
                                  std::to_string(labels.numel()) + " labels for " +
                                  std::to_string(images.size(0)) + " images");
  }
  auto x = images.to(torch::kFloat32).div_(255.0).sub_(kMean).div_(kStd).unsqueeze(1);
  return {x.contiguous(), labels.to(torch::kInt64)};
}

}  // namespace fashion_mnist
