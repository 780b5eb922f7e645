// defines: how the MPI engine hands tensors to MPI: a tensor's bytes,
// whether a list of tensors is one buffer MPI can use in place, and the
// copies where it is not.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace cohort::mpi {

inline const char* ptr(const at::Tensor& t) { return static_cast<const char*>(t.data_ptr()); }
inline int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// True when `parts` lie back to back in one buffer, equally sized, as the
// communicator's *_into_tensor forms pass them: MPI can use them in place.
inline bool back_to_back(const std::vector<at::Tensor>& parts) {
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!parts[i].is_contiguous() || parts[i].numel() != parts[0].numel() ||
        ptr(parts[i]) != ptr(parts[0]) + static_cast<int64_t>(i) * nbytes(parts[0])) {
      return false;
    }
  }
  return true;
}

inline bool overlaps(const char* a, int64_t a_bytes, const char* b, int64_t b_bytes) {
  return a_bytes > 0 && b_bytes > 0 && a < b + b_bytes && b < a + a_bytes;
}

// The parts as one flat tensor: a copy.
inline at::Tensor concat(const std::vector<at::Tensor>& parts) {
  std::vector<at::Tensor> flat;
  for (auto& p : parts) flat.push_back(p.reshape({-1}));
  return at::cat(flat);
}

// After MPI filled `flat`, hand each part its slice.
inline std::function<void()> copy_out(std::vector<at::Tensor> parts, at::Tensor flat) {
  return [parts, flat]() mutable {
    int64_t offset = 0;
    for (auto& p : parts) {
      p.view({-1}).copy_(flat.narrow(0, offset, p.numel()));
      offset += p.numel();
    }
  };
}

}  // namespace cohort::mpi
