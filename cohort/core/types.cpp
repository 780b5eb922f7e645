#include "cohort/core/types.h"

namespace cohort {

std::string to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Prod:
      return "prod";
  }
  return "unknown";
}

}  // namespace cohort
