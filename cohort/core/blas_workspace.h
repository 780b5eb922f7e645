// defines: reserve_blas_workspace, which makes the BLAS take its per-process
// workspace now, while memory is there.
//
// Why: OpenBLAS (0.3.21 in Debian 12, under LibTorch's matrix products) maps
// a 128 MiB workspace at the first matrix product, and when neither mmap nor
// malloc can give it (a data or address-space limit, a full cgroup) it
// retries forever: the rank spins instead of failing, and its job hangs.
// Later OpenBLAS releases exit the process instead. Once the workspace exists
// it is reused (by any thread), so a later out-of-memory comes from
// LibTorch's allocator as a c10::Error that names the allocation. Not
// covered: a second thread multiplying at the same moment takes a second
// workspace, which can still spin.
#pragma once

namespace cohort {

// Runs one small float32 matrix product, once per process (later calls do
// nothing); a rank joining a job calls it (connect(), so init() too).
void reserve_blas_workspace();

}  // namespace cohort
