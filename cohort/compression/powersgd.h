// defines: make_powersgd, the PowerSGD compressor (Vogels et al., 2019; as
// PyTorch's powerSGD_hook, with its state checkpointable).
//
// Per tensor key and step: the input (plus the error feedback) is split into
// matrices (a parameter rows x rest viewed as a matrix) worth compressing and
// the rest (vectors such as biases, and matrices whose
// (rows + cols) * rank * min_compression_rate >= rows * cols); the rest is
// all-reduced as it is. Matrices of one shape form one batch, compressed in
// place (no copies of the input): P = M Q, all-reduce P, orthogonalize P,
// Q = M^T P, all-reduce Q (averaged), M ~ P Q^T. Q starts random (a seed shared by all
// ranks) and, with warm start, each step continues from the last step's Q.
// Before start_iteration steps of a key, the key is all-reduced uncompressed.
#pragma once

#include <memory>

#include "cohort/compression/compressor.h"

namespace cohort::compression {

/// A PowerSGD compressor (options.kind is not looked at).
std::unique_ptr<Compressor> make_powersgd(const CompressionOptions& options);

}  // namespace cohort::compression
