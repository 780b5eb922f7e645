// defines: ring_attention, causal self-attention over a sequence split across
// the context-parallel group in the zig-zag layout (layout.h), and its
// options.
//
// Each rank keeps its queries; the K/V blocks travel around the ring (rank r
// sends to r+1, receives from r-1), one hop per step, for cp steps. The
// transfer of the next block is posted before the current block's attention
// is computed, so it runs on the engine's thread meanwhile. An online softmax
// (running max and sum of exponentials per query row) folds the blocks in,
// so the result is one softmax over the whole causal prefix. Parts of a
// block that lie entirely in a chunk's future are never computed. Backward
// sends the K/V blocks around again with dK/dV accumulators following them,
// recomputing each block's probabilities from the saved log-sum-exp.
//
// Cost model, cp ranks, local rows L = S/cp, batch·heads BH, head_dim D,
// element size e, per-message latency alpha, per-byte time beta:
//   forward:   cp-1 steps, each sends and receives one K/V block of
//              2·BH·L·D·e bytes: (cp-1)(alpha + 2 BH L D e beta)
//   backward:  cp-1 K/V steps as above, and cp dK/dV steps of the same size
//   compute:   a block from another rank: L²/2 scores per batch·head (one
//              of its chunks, or one chunk of the queries, lies wholly in
//              the future and is skipped); the own block 3L²/4 (the
//              diagonal chunks computed whole, then masked). A score costs
//              4·D flops forward (q·kᵀ, p·v), 10·D backward (recomputed
//              scores, dV, dP, dQ, dK): BH·D·L²·(2cp+1) flops forward on
//              every rank alike.
//   memory:    beside q, k, v, out and the log-sum-exp, two K/V blocks (the
//              one computed and the one arriving) and one piece's scores,
//              at most BH·(L/2)·L elements: no S×S matrix.
// Overlap hides a step's transfer when its bytes take less than its compute.
#pragma once

#include <torch/types.h>

#include <memory>

#include "cohort/comm/communicator.h"
#include "cohort/core/types.h"
#include "cohort/mesh/device_mesh.h"

namespace cohort::context_parallel {

/// Options of ring_attention.
struct RingAttentionOptions {
  /// Softmax scale of q·kᵀ; 0 means 1/sqrt(head_dim).
  double scale = 0;
  /// The call's messages use tags [tag, tag + 3·cp) of the group.
  int tag = 0;
  /// Timeout of each transfer and of the shape agreement (kDefaultTimeout:
  /// the group's).
  Millis timeout = kDefaultTimeout;
  /// Post each step's transfer before its block's attention, so the two run
  /// together (false: finish it first; the baseline that shows what overlap
  /// hides).
  bool overlap = true;
  /// For tests only: the ring step (0 .. cp-1) whose K/V block is left out
  /// of forward and backward, so a test can show that its check notices a
  /// missing block. Negative: none.
  int skip_step = -1;
};

/// Causal attention softmax(q·kᵀ·scale + mask)·v of this rank's rows, where
/// q, k and v are [batch, heads, rows, head_dim] float32 or float64 CPU
/// tensors holding this rank's two zig-zag chunks (shard_sequence), and the
/// mask compares global positions. Differentiable in q, k and v. Collective
/// over `group` (the cp ranks): every rank calls it with the same batch,
/// heads, head_dim, dtype and scale, and its layout's number of rows; one small
/// all-gather agrees on them first, so a rank that differs is an
/// InvalidArgument on every rank. Its backward communicates too, so every
/// rank runs backward through it. The group stays alive with the graph.
torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::shared_ptr<Communicator>& group,
                             const RingAttentionOptions& options = {});
/// The same over a 1-D mesh (mesh["cp"]): its group; InvalidArgument naming
/// the mesh when it has more dimensions.
inline torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const DeviceMesh& cp,
                                    const RingAttentionOptions& options = {}) {
  return ring_attention(q, k, v, one_dimension_group(cp, "ring_attention", "cp"), options);
}

}  // namespace cohort::context_parallel
