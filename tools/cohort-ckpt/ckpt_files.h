// defines: inspect_checkpoint and consolidate_checkpoint, the two halves of
// cohort-ckpt over a distributed checkpoint folder (cohort/dcp).
#pragma once

#include <string>

namespace cohort_ckpt {

/// The checkpoint's tensors as text: name, dtype, global shape, layout, and
/// per chunk its file, box, byte offset and crc32s. `verify`: also read
/// every chunk and check its checksums (throws CheckpointError on a bad one).
std::string inspect_checkpoint(const std::string& dir, bool verify);

/// Writes the tensors named `prefix`<fqn> ("model." by default: the
/// model's parameters and buffers), whole, to `out` as the archive that
/// torch::save(module, out) writes, so torch::load(module, out) loads them
/// into the bare model. Returns the number of tensors written.
int consolidate_checkpoint(const std::string& dir, const std::string& out,
                           const std::string& prefix = "model.");

}  // namespace cohort_ckpt
