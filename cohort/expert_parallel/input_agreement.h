// defines: the words an MoE's ranks exchange about their inputs before the
// rows move, riding the tp agreement, the load-balancing all-reduce (sequence
// group) and the count exchange (ep group), in that order: a refusal of the
// input (its kind, the relay it came through, a value) and the backward
// flags (whether a rank records the exchanges' backward, or cannot). Each
// group relays what it heard to the next, so that every rank of the three
// hears every rank's refusal and flags before anything else moves.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <string>

namespace cohort::expert_parallel {

/// The kind of a refusal, in bits 0-7 of its word; bits 8-19 and 20-31 hold
/// the sequence-group and tensor-parallel rank + 1 it was relayed from (0:
/// not relayed over that group), bits 32 and up its value (a width, a
/// dtype, a tp rank), signed, at most 2^20 - 1 so that the word is exact in
/// the load-balancing all-reduce's doubles.
enum Refusal : int64_t {
  kWidth = 1,     // the input's last dimension is not hidden (value: it; -1: 0-dimensional)
  kDtype = 2,     // the input's dtype is not the parameters' (value: it)
  kTpInput = 3,   // the TP ranks hold different inputs (value: the first tp rank off tp rank 0's)
  kTpRouter = 4,  // the TP ranks hold different routers (value: as kTpInput)
};
constexpr int kCpShift = 8, kTpShift = 20;

int64_t refusal_word(Refusal kind, int64_t value);
/// `word` as heard from rank `rank` of a group (`shift`: kCpShift, kTpShift).
int64_t relayed(int64_t word, int rank, int shift);
/// The rank `word` was relayed from over that group, or -1.
int relayed_from(int64_t word, int shift);
/// Why the input was refused (`hidden`, `dtype`: the layer's).
std::string refusal_text(int64_t word, int64_t hidden, c10::ScalarType dtype);

/// Backward flags, OR-ed over the groups: a rank records the exchanges'
/// backward (grad mode on, and its input or a parameter requires grad),
/// runs without grad mode, heard of a peer without it, or its input
/// requires grad (its rows' gradient is all-reduced over tp).
enum Backward : int64_t { kRecords = 1, kNoGradMode = 2, kPeerNoGradMode = 4, kInputGrad = 8 };
/// `flags` with a peer's merged in.
int64_t merged(int64_t flags, int64_t peer);

/// A digest of `t`'s shape, dtype and bytes: equal tensors give equal
/// digests on every rank of one device type. A tensor off the CPU is
/// digested where it is (device_content_digest), never copied to the host.
int64_t tensor_digest(const torch::Tensor& t);

/// Two 64-bit sums of `t`'s bytes, computed on its device with its own
/// kernels: the bytes as integers of the element's width, each times a
/// position-dependent odd multiplier, summed modulo 2^64. Only the two sums
/// cross to the host. Tensors that differ in one element always differ in
/// both; it is not a cryptographic hash.
std::array<int64_t, 2> device_content_digest(const torch::Tensor& t);

}  // namespace cohort::expert_parallel
