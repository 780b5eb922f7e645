// defines: write_checkpoint_file (atomic, checksummed) and
// read_checkpoint_file (verifies, throws CheckpointError naming the file
// and what is wrong).
//
// On disk: a 24-byte header, then the payload (a serialized
// torch::serialize::OutputArchive).
//   bytes 0..7   magic "COHORTCK"
//   bytes 8..11  format version (uint32, little endian), kCheckpointVersion
//   bytes 12..15 crc32 (zlib) of the payload
//   bytes 16..23 payload length in bytes (uint64)
// The length catches truncation, the crc catches flipped bytes, the magic
// catches a file that is not a checkpoint at all.
//
// Writing is atomic: a temporary file in the same folder, fsync, rename
// over the final name, fsync of the folder. A crash leaves either the old
// state or the new file, never half a file under the final name.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cohort/core/error.h"

namespace cohort {

inline constexpr uint32_t kCheckpointVersion = 1;
inline constexpr size_t kCheckpointHeaderBytes = 24;

// A checkpoint file that cannot be used throws CheckpointError
// (core/error.h), its message starting with "checkpoint <path>: ".

/// The zlib crc32 of `bytes` bytes at `data` (any length).
uint32_t crc32_of(const void* data, size_t bytes);

/// Writes the concatenation of `pieces` (pointer, length) to `path`
/// atomically, without copying them into one buffer first. Throws Error on
/// an I/O failure (with the path and errno text); never leaves a partial
/// file at `path`.
void write_file_atomically(const std::string& path,
                           const std::vector<std::pair<const void*, size_t>>& pieces);

/// Writes `payload` to `path` atomically. Throws Error on an I/O failure
/// (with the path and errno text); never leaves a partial file at `path`.
void write_checkpoint_file(const std::string& path, const std::string& payload);

/// Reads and verifies `path`; returns the payload.
std::string read_checkpoint_file(const std::string& path);

}  // namespace cohort
