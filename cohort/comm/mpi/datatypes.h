// defines: to_mpi_type and to_mpi_op, the map from tensors and ReduceOp to
// MPI's handles.
#pragma once

#define OMPI_SKIP_MPICXX 1
#include <ATen/ATen.h>
#include <mpi.h>

#include "cohort/core/types.h"

namespace cohort::mpi {

// The MPI datatype `dtype` travels as. Reductions see f32, f64, i32, i64 and
// u8 (the communicator widens f16/bf16 to f32); data movement also sees f16,
// which carries bf16 bits too, and goes as MPI_UINT16_T because only its bits
// matter. Throws Unsupported naming `what` for anything else, and for f16
// in a reduction, where summing its bits as integers would be garbage.
MPI_Datatype to_mpi_type(at::ScalarType dtype, const char* what, bool reduction = false);

MPI_Op to_mpi_op(ReduceOp op);

// Element counts are C ints in MPI 3: throws InvalidArgument past INT_MAX.
int to_mpi_count(int64_t n, const char* what);

}  // namespace cohort::mpi
