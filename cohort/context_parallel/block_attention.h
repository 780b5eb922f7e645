// defines: the local arithmetic of ring attention: which parts of a K/V block
// a rank's queries see under the causal mask, the online-softmax forward
// over those parts, and their backward recomputed from the log-sum-exp.
//
// Tensors are [batch, heads, rows, head_dim]; softmax statistics are
// [batch, heads, rows]. Nothing here communicates.
#pragma once

#include <torch/types.h>

#include <vector>

#include "cohort/context_parallel/layout.h"

namespace cohort::context_parallel {

// A query chunk against a key prefix of one K/V block: query rows
// [offset, offset + rows) of the local q, key rows [0, keys) of the block.
// The key chunks of a block ascend, so what a query chunk sees of a block is
// always a prefix. `diagonal`: the last `rows` keys are the query chunk
// itself, masked causally; the keys before them are all visible.
struct Piece {
  int64_t offset = 0;
  int64_t rows = 0;
  int64_t keys = 0;
  bool diagonal = false;
};

// The pieces of rank q_rank's queries against rank k_rank's K/V block: one
// per query chunk that sees any key of it (a block entirely in the future of
// a chunk yields none, so it is never computed).
std::vector<Piece> visible_pieces(const ZigZagLayout& layout, int q_rank, int k_rank);

// Running statistics of the online softmax per query row: the largest score
// so far, the sum of exp(score - max) and the unnormalized output.
struct SoftmaxState {
  torch::Tensor max;  // [B, H, L], starts at -inf
  torch::Tensor sum;  // [B, H, L]
  torch::Tensor acc;  // [B, H, L, D]
};

SoftmaxState start_softmax(const torch::Tensor& q);

// Folds one piece of attention of q against (k, v) into `state`.
void accumulate(SoftmaxState& state, const torch::Tensor& q, const torch::Tensor& k,
                const torch::Tensor& v, const Piece& piece, double scale);

// The output (acc / sum) and the log-sum-exp of each row's scores.
std::pair<torch::Tensor, torch::Tensor> finish_softmax(const SoftmaxState& state);

// What the backward of every block needs from this rank's queries.
struct QuerySide {
  torch::Tensor q;      // [B, H, L, D]
  torch::Tensor dout;   // [B, H, L, D]
  torch::Tensor lse;    // [B, H, L]
  torch::Tensor delta;  // rowsum(dout * out), [B, H, L]
  double scale = 1.0;
};

// Adds one piece's gradients: into dq (rows of the piece) and into dk, dv
// (the piece's key prefix of the block).
void accumulate_grads(const QuerySide& side, const torch::Tensor& k, const torch::Tensor& v,
                      const Piece& piece, torch::Tensor& dq, torch::Tensor& dk, torch::Tensor& dv);

}  // namespace cohort::context_parallel
