#include "cohort/core/blas_workspace.h"

#include <ATen/ATen.h>

#include <mutex>

namespace cohort {

void reserve_blas_workspace() {
  static std::once_flag once;
  std::call_once(once, [] {
    // 256 x 256: OpenBLAS runs products of at most about 100^3 multiply-adds
    // through small-matrix kernels that need no workspace, and LibTorch
    // computes tiny ones itself (64 x 64 did not take the workspace here).
    const auto a = at::ones({256, 256}, at::kFloat);
    (void)at::mm(a, a);
  });
}

}  // namespace cohort
