// defines: Routing and route(), the top-k router's decisions for one rank's
// batch, and load_balancing_loss(), Switch Transformer's auxiliary loss.
//
// The decisions, written out so that a one-process run reproduces them:
//   probabilities  softmax of the router's logits over all E experts;
//   choices        the k largest (torch::topk: among equal logits its own
//                  pick, the same for a row on every rank of one device type);
//   gates          k = 1: the chosen probability itself (Switch: the router
//                  learns through it); k = 2: the two chosen probabilities
//                  renormalized to sum to one (GShard, Mixtral);
//   capacity       C = ceil(capacity_factor * T * k / E) assignments per
//                  expert for this rank's T tokens (at most T * k);
//   dropping       assignments claim their expert's C slots first come,
//                  first served: every token's first choice in token order,
//                  then every token's second choice in token order (so a
//                  second choice never displaces a first one, as in GShard).
//                  An assignment past its expert's C is dropped: it adds
//                  nothing to the token's output.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort::expert_parallel {

/// One rank's routing. Assignment a = choice * T + token (choice-major), so
/// index order is the order in which assignments claim capacity.
struct Routing {
  torch::Tensor probs;   ///< [T, E] softmax of the logits (differentiable)
  torch::Tensor expert;  ///< [T * k] int64, the expert of each assignment
  torch::Tensor token;   ///< [T * k] int64, the token of each assignment
  torch::Tensor gate;    ///< [T * k] the weight of each assignment (differentiable)
  torch::Tensor kept;    ///< [T * k] bool, false where the assignment was dropped
  int64_t capacity = 0;  ///< C, slots per expert
};

/// The routing of `logits` [T, E] (see the file comment); k is 1 or 2.
Routing route(const torch::Tensor& logits, int64_t k, double capacity_factor);

/// C = ceil((tokens * k / experts) * capacity_factor) in doubles, in
/// Megatron-Core's order of operations (get_capacity), at most tokens * k.
int64_t expert_capacity(double capacity_factor, int64_t tokens, int64_t k, int64_t experts);

/// Switch Transformer's E * sum_e f_e * P_e: f_e the share of the T * k
/// assignments that chose expert e (counted before dropping; no gradient),
/// P_e the mean probability of e over the T tokens. 1 when both are uniform;
/// 0 (still in the graph) for a rank without tokens.
torch::Tensor load_balancing_loss(const Routing& routing);

/// The same loss over the tokens of every rank of `sequence_group`, the
/// ranks that hold other tokens of the same sequences (context parallelism):
/// f_e from the assignments and P_e from the probabilities summed over the
/// group, as Megatron-Core reduces them over its tp x cp group. Every rank
/// returns the loss of the whole sequences. Its gradient reaches this rank's
/// probabilities only, weighted by the group's size, for the average over
/// the group that follows (as context_parallel::sequence_mean_loss): the
/// average of the ranks' gradients is the whole loss's. Collective over the
/// group: one all-reduce of 2 E + 2 doubles; every rank must route to the
/// same E experts (the MoE agrees on it when built).
torch::Tensor load_balancing_loss(const Routing& routing, Communicator& sequence_group);

/// As load_balancing_loss over `sequence_group`, with `mine` (the same
/// number of words on every rank, each exact in a double) riding in the same
/// all-reduce (the MoE's refusal of its input and its backward flags):
/// returns every rank's words in `all`, rank-major. A rank with a nonzero
/// refusal may pass the routing of no tokens.
torch::Tensor load_balancing_loss(const Routing& routing, Communicator& sequence_group,
                                  const std::vector<int64_t>& mine, std::vector<int64_t>& all);

}  // namespace cohort::expert_parallel
