// defines: tensor_parallel_state_dict (internal: get_state_dict with
// StateDictOptions::mesh, state_dict.h, calls it): one pipeline stage of a
// tensor-parallel model (cohort/tensor_parallel layers on a DeviceMesh) and
// its optimizer as a dcp::StateDict under the unsplit model's names
// ("model.<fqn>", "optim.<fqn>.<state>", as adapters.h), so a checkpoint
// saved at one tp x pp x dp loads into any other (and into DDP, ZeRO or
// FSDP at tp = pp = 1, and back). A parameter the TP layers split
// (tensor_parallel::split_dims: column and row weights, a column bias, a
// vocabulary table, what a TensorParallelModule of one's own names; an
// expert's w1, b1 and w2 split over tp,
// expert_parallel::expert_tensor_split_dims) is TP rank r's slice r of tp
// along its split dimension;
// everything else is whole (replicated over TP). With a mesh "ep" dimension
// above 1, an expert parameter (expert_parallel::expert_parameters, [E / ep,
// ...]) is ep rank r's box r of ep along dimension 0 of the global [E, ...]
// tensor; "cp" ranks hold replicas, as "dp" ranks do. Optimizer state is cut like
// its parameter, the step is a 0-d tensor. A stage holds only its own
// parameters, under the names they have in the unsplit model (the model
// names its layers by their global index), so another pp split finds them.
// `tied` maps the name of a parameter that is a copy of another (a tied
// output embedding held by the last stage) to the name of the original: the
// copy is never written and loads from the original's tensors and
// optimizer state.
//
// Written once: every element of a tensor is written by one rank of the
// ranks that hold it (the DP and CP replicas, and the EP and TP ranks where
// they do not split the tensor, take turns tensor by tensor), so replicas
// cost nothing on disk.
//
// for_load = nullptr: every tensor this rank holds, those another rank
// writes marked so. Not collective: an MoE whose groups are not the mesh's
// throws on this rank alone, so get_state_dict agrees first
// (agree_moe_groups), and a rebuild at save throws inside save, which
// agrees its errors. for_load = a checkpoint's metadata: the targets for
// loading it; then this is collective over mesh.process_group(): an MoE
// whose groups are not the mesh's is an InvalidArgument, and a sharded
// tensor whose checkpointed dimension does not divide by tp (the layout
// cannot hold it; for experts: E that does not divide by ep) a
// CheckpointError naming it, on every rank, before anything is read.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <map>
#include <string>

#include "cohort/dcp/dcp.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/mesh/device_mesh.h"

namespace cohort::dcp::detail {

/// "dcp::get_state_dict: <why>" when an expert_parallel::MoE inside `stage`
/// is split over other groups than the mesh's "ep" and "tp", or at another
/// position in them (expert_parallel::mesh_mismatch); "" otherwise.
std::string moe_groups_error(const torch::nn::Module& stage, const DeviceMesh& mesh);

/// Collective over mesh.process_group() (one all-gather of a word when no
/// rank failed): InvalidArgument on every rank, with the lowest failing
/// rank's moe_groups_error, when any rank has one. A rank whose groups
/// happen to fit (an ep group in another order fits where a rank's position
/// is the same) would otherwise go on and wait in save or load for the
/// ranks that threw.
void agree_moe_groups(const torch::nn::Module& stage, const DeviceMesh& mesh);

/// This rank's stage of a model built from cohort/tensor_parallel layers
/// over mesh["tp"], or a pipeline stage, and the optimizer over its
/// parameters (may be null). Of the mesh's dimensions, "tp" splits the TP
/// layers' tensors (none: tp = 1), "ep" the experts, "pp" holds other
/// stages, and any other holds replicas of the stage.
StateDict tensor_parallel_state_dict(torch::nn::Module& stage, const DeviceMesh& mesh,
                                     torch::optim::Optimizer* optimizer, const TiedNames& tied = {},
                                     const Metadata* for_load = nullptr);

}  // namespace cohort::dcp::detail
