#include "cohort/comm/mpi/datatypes.h"

#include <climits>

#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"

namespace cohort::mpi {

MPI_Datatype to_mpi_type(at::ScalarType dtype, const char* what, bool reduction) {
  switch (reduction && dtype == at::kHalf ? at::kBFloat16 : dtype) {
    case at::kFloat:
      return MPI_FLOAT;
    case at::kDouble:
      return MPI_DOUBLE;
    case at::kInt:
      return MPI_INT32_T;
    case at::kLong:
      return MPI_INT64_T;
    case at::kByte:
      return MPI_UINT8_T;
    case at::kHalf:
      return MPI_UINT16_T;
    default:
      break;
  }
  throw Unsupported(std::string("engine mpi does not support dtype ") + dtype_name(dtype) + " in " +
                    what);
}

MPI_Op to_mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return MPI_SUM;
    case ReduceOp::Min:
      return MPI_MIN;
    case ReduceOp::Max:
      return MPI_MAX;
    case ReduceOp::Prod:
      return MPI_PROD;
    case ReduceOp::Avg:
      break;
  }
  COHORT_CHECK(false, "the communicator turns avg into sum before the engine");
}

int to_mpi_count(int64_t n, const char* what) {
  if (n > INT_MAX) {
    throw InvalidArgument(std::string("engine mpi: ") + what + " of " + std::to_string(n) +
                          " elements exceeds MPI's int count (" + std::to_string(INT_MAX) + ")");
  }
  return static_cast<int>(n);
}

}  // namespace cohort::mpi
