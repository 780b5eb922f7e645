// defines: Error and its kinds (InvalidArgument and its ScheduleError,
// ConfigError, TimeoutError, PeerError, MismatchError, Unsupported,
// CheckpointError, StageError), COHORT_CHECK for broken invariants: every public
// exception type, in one place.
//
// Two kinds of failure, as in docs/errors.md: what a caller or a peer can cause
// (bad input, a dead or slow rank, a bad environment) is one of the exception
// types below and carries the operation, the rank and the peer in its message;
// a broken internal invariant is COHORT_CHECK, which names file and line.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace cohort {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A tensor, an option or an argument the caller passed is not acceptable.
/// Raised synchronously, before anything is sent, so nothing is lost.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// The environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) or an init option is
/// missing or malformed.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// An operation did not complete within its timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

/// A peer closed its connection, died, or the transport failed.
class PeerError : public Error {
 public:
  using Error::Error;
};

/// Debug mode found ranks that called different collectives, or the same one
/// with different shapes or dtypes.
class MismatchError : public Error {
 public:
  using Error::Error;
};

/// The engine does not implement this operation or dtype.
class Unsupported : public Error {
 public:
  using Error::Error;
};

/// A pipeline schedule that is malformed or would deadlock. what() names the
/// failing action and prints the step-by-rank grid with the failing step(s)
/// marked (cohort/pipeline/schedule_validator.h).
class ScheduleError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

/// A checkpoint that cannot be used: missing, truncated, corrupt, of another
/// format, or (Trainer::resume) only damaged ones where a good one was
/// required. The message names the file or folder.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// A pipeline stage's own code (its forward, the last stage's loss
/// function, its backward) threw: every rank of the pipeline throws it at
/// the step's end, naming the stage, its rank, the micro-batch and the
/// original message. On the rank whose code threw, the original exception
/// is nested (std::rethrow_if_nested).
class StageError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void check_failed(const char* file, int line, const char* cond,
                               const std::string& message);
}  // namespace detail

}  // namespace cohort

// Invariants that only a bug in cohort can break.
#define COHORT_CHECK(cond, msg)                                                          \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::ostringstream cohort_check_os_;                                               \
      cohort_check_os_ << msg;                                                           \
      ::cohort::detail::check_failed(__FILE__, __LINE__, #cond, cohort_check_os_.str()); \
    }                                                                                    \
  } while (0)
