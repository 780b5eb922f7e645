// defines: agree and gather_strings, the two small collectives that make a
// checkpoint error one rank met an error on every rank.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort::dcp {

/// The error agree() throws on every rank for the lowest failing rank's.
enum class ErrorKind : char { Checkpoint, InvalidArgument, Config };

/// The kind agree() keeps for `e`: an InvalidArgument (a shard that does not
/// fit its box) or a ConfigError (a checkpoint the optimizer's groups cannot
/// hold) stays one; anything else, met reading or writing a checkpoint, is a
/// CheckpointError.
ErrorKind kind_of(const std::exception& e);

/// Collective: every rank passes its error ("" when none) and its kind.
/// Throws on every rank, as the lowest failing rank's kind, that rank's
/// message ("rank r: ...") when any rank failed.
void agree(Communicator& comm, const std::string& error, ErrorKind kind = ErrorKind::Checkpoint);

/// Throws what agree() throws for rank `rank`'s `text` (its kind's byte, then
/// its message).
[[noreturn]] void throw_agreed(int rank, const std::string& text);

/// Collective: every rank's string, on every rank, in rank order (one
/// all-gather of the lengths, one of the strings padded to the longest).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

/// Collective: rank `root` gets every rank's string, in rank order; the
/// others get an empty vector.
std::vector<std::string> gather_strings(Communicator& comm, const std::string& mine, int root);

}  // namespace cohort::dcp
