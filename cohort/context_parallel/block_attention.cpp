// Blockwise attention with an online softmax (as in FlashAttention): each
// piece rescales the running sums by exp(old max - new max) before adding
// its own, so the result after every block equals one softmax over all of
// them. Backward recomputes each piece's probabilities from the saved
// log-sum-exp instead of keeping them: memory stays one block's scores.
#include "cohort/context_parallel/block_attention.h"

#include <limits>

namespace cohort::context_parallel {

std::vector<Piece> visible_pieces(const ZigZagLayout& layout, int q_rank, int k_rank) {
  const auto qc = layout.chunks_of(q_rank);
  const auto kc = layout.chunks_of(k_rank);
  std::vector<Piece> pieces;
  int64_t offset = 0;
  for (int q : qc) {
    Piece p;
    p.offset = offset;
    p.rows = layout.chunk_length(q);
    // Chunks are disjoint ranges: a key chunk before the query chunk is all
    // visible, the same chunk is the diagonal, a later one all masked.
    for (int k : kc) {
      if (k <= q) p.keys += layout.chunk_length(k);
      if (k == q) p.diagonal = true;
    }
    if (p.keys > 0) pieces.push_back(p);
    offset += p.rows;
  }
  return pieces;
}

SoftmaxState start_softmax(const torch::Tensor& q) {
  auto stats = q.sizes().slice(0, 3);
  return {torch::full(stats, -std::numeric_limits<double>::infinity(), q.options()),
          torch::zeros(stats, q.options()), torch::zeros_like(q)};
}

namespace {

// Scores of the piece, with the future positions of the diagonal at -inf.
// Every row sees at least itself, so no row is all -inf.
torch::Tensor scores(const torch::Tensor& q, const torch::Tensor& k, const Piece& p, double scale) {
  auto s = q.narrow(2, p.offset, p.rows).matmul(k.narrow(2, 0, p.keys).transpose(-2, -1)) * scale;
  if (p.diagonal) {
    auto future = torch::ones({p.rows, p.rows}, q.options().dtype(torch::kBool)).triu(1);
    s.narrow(-1, p.keys - p.rows, p.rows)
        .masked_fill_(future, -std::numeric_limits<double>::infinity());
  }
  return s;
}

}  // namespace

void accumulate(SoftmaxState& state, const torch::Tensor& q, const torch::Tensor& k,
                const torch::Tensor& v, const Piece& p, double scale) {
  auto s = scores(q, k, p, scale);
  auto max = state.max.narrow(2, p.offset, p.rows);
  auto sum = state.sum.narrow(2, p.offset, p.rows);
  auto acc = state.acc.narrow(2, p.offset, p.rows);
  auto new_max = torch::maximum(max, std::get<0>(s.max(-1)));
  auto rescale = (max - new_max).exp_();
  auto probs = (s - new_max.unsqueeze(-1)).exp_();
  sum.mul_(rescale).add_(probs.sum(-1));
  acc.mul_(rescale.unsqueeze(-1)).add_(probs.matmul(v.narrow(2, 0, p.keys)));
  max.copy_(new_max);
}

std::pair<torch::Tensor, torch::Tensor> finish_softmax(const SoftmaxState& state) {
  return {state.acc / state.sum.unsqueeze(-1), state.max + state.sum.log()};
}

void accumulate_grads(const QuerySide& side, const torch::Tensor& k, const torch::Tensor& v,
                      const Piece& p, torch::Tensor& dq, torch::Tensor& dk, torch::Tensor& dv) {
  auto probs =
      (scores(side.q, k, p, side.scale) - side.lse.narrow(2, p.offset, p.rows).unsqueeze(-1))
          .exp_();
  auto dout = side.dout.narrow(2, p.offset, p.rows);
  auto keys = k.narrow(2, 0, p.keys);
  dv.narrow(2, 0, p.keys).add_(probs.transpose(-2, -1).matmul(dout));
  auto dprobs = dout.matmul(v.narrow(2, 0, p.keys).transpose(-2, -1));
  auto dscores = probs.mul_(dprobs.sub_(side.delta.narrow(2, p.offset, p.rows).unsqueeze(-1)));
  dq.narrow(2, p.offset, p.rows).add_(dscores.matmul(keys), side.scale);
  dk.narrow(2, 0, p.keys)
      .add_(dscores.transpose(-2, -1).matmul(side.q.narrow(2, p.offset, p.rows)), side.scale);
}

}  // namespace cohort::context_parallel
