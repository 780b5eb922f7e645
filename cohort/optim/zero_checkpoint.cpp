// ZeroRedundancyOptimizer, checkpoint half: the sharded save/load (each rank
// its own archive) and consolidate_state_dict (everything on one rank).

#include "cohort/core/error.h"
#include "cohort/core/torch_compat.h"
#include "cohort/optim/optimizer_state.h"
#include "cohort/optim/zero_redundancy_optimizer.h"

namespace cohort {
namespace {

// What a shard archive must agree on with the optimizer loading it.
torch::Tensor layout_signature(const ZeroRedundancyOptimizer& zero) {
  const auto& p = zero.partition();
  return torch::tensor({static_cast<int64_t>(p.world()), static_cast<int64_t>(p.rank()), p.numel(),
                        p.padded_numel(), static_cast<int64_t>(p.params().size()),
                        static_cast<int64_t>(p.buckets().size()),
                        static_cast<int64_t>(zero.options().stage)});
}

const char* kSignatureNames[] = {"world size", "rank",    "elements", "padded elements",
                                 "parameters", "buckets", "stage"};

}  // namespace

void ZeroRedundancyOptimizer::save_shard(torch::serialize::OutputArchive& archive) const {
  archive.write("zero_layout", layout_signature(*this));
  torch::serialize::OutputArchive inner;
  inner_->save(inner);
  archive.write("zero_shard_optimizer", inner);
}

void ZeroRedundancyOptimizer::load_shard(torch::serialize::InputArchive& archive) {
  torch::Tensor saved;
  archive.read("zero_layout", saved);
  const auto mine = layout_signature(*this);
  if (saved.numel() != mine.numel()) {
    throw MismatchError(where("load_shard") + ": the archive is not a ZeRO shard of this version");
  }
  for (int64_t i = 0; i < mine.numel(); ++i) {
    if (saved[i].item<int64_t>() != mine[i].item<int64_t>()) {
      throw MismatchError(where("load_shard") + ": the shard was saved with " + kSignatureNames[i] +
                          " " + std::to_string(saved[i].item<int64_t>()) + ", this optimizer has " +
                          std::to_string(mine[i].item<int64_t>()));
    }
  }
  torch::serialize::InputArchive inner;
  archive.read("zero_shard_optimizer", inner);
  inner_->load(inner);
}

std::vector<std::map<std::string, torch::Tensor>> ZeroRedundancyOptimizer::consolidate_state_dict(
    int to) {
  torch::NoGradGuard no_grad;
  const auto& part = *partition_;
  const int world = comm_->size();
  if (to < 0 || to >= world) {
    throw InvalidArgument(where("consolidate_state_dict") + ": no rank " + std::to_string(to));
  }
  const auto names = state_names(*inner_);
  const auto n_params = static_cast<int64_t>(params_.size());
  // Per name, this rank's shard of the state (zeros where it has none);
  // per parameter, its step count and whether it has state (-1: none).
  std::vector<torch::Tensor> shards;
  for (size_t n = 0; n < names.size(); ++n) {
    shards.push_back(torch::zeros({part.shard_numel()}, flat_params_.options()));
  }
  auto present = torch::zeros({static_cast<int64_t>(names.size()), n_params}, torch::kLong);
  auto steps = torch::full({n_params}, -1, torch::kLong);
  const auto& pieces = part.pieces();
  for (size_t k = 0; k < pieces.size(); ++k) {
    auto it = inner_->state().find(optimizer_state_key(pieces_[k]));
    if (it == inner_->state().end()) continue;
    const auto step = state_step(*it->second);
    if (step) steps[pieces[k].param] = *step;
    for (const auto& [name, tensor] : state_tensors(*it->second)) {
      const auto n = std::find(names.begin(), names.end(), name) - names.begin();
      shards[n].narrow(0, pieces[k].shard_offset, pieces[k].numel).copy_(tensor.reshape(-1));
      present[n][pieces[k].param] = 1;
    }
  }
  // Every piece of one parameter has the same history, so Max merges them.
  std::vector<Work> works;
  works.push_back(comm_->reduce(steps, {to, ReduceOp::Max}));
  works.push_back(comm_->reduce(present, {to, ReduceOp::Max}));
  std::vector<std::vector<torch::Tensor>> gathered(names.size());
  for (size_t n = 0; n < names.size(); ++n) {
    if (comm_->rank() == to) {
      for (int r = 0; r < world; ++r) gathered[n].push_back(torch::empty_like(shards[n]));
    }
    works.push_back(comm_->gather(gathered[n], shards[n], {to}));
  }
  for (auto& w : works) w.wait();
  if (comm_->rank() != to) return {};

  std::vector<std::map<std::string, torch::Tensor>> out(params_.size());
  for (size_t n = 0; n < names.size(); ++n) {
    // Undo the partition: chunk r of bucket b is at b.shard_offset in shard r.
    auto flat = torch::zeros({part.padded_numel()}, flat_params_.options());
    for (const auto& b : part.buckets()) {
      for (int r = 0; r < world; ++r) {
        flat.narrow(0, b.offset + r * b.chunk, b.chunk)
            .copy_(gathered[n][r].narrow(0, b.shard_offset, b.chunk));
      }
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      if (present[n][i].item<int64_t>() == 0) continue;
      const auto& prm = part.params()[i];
      out[i][names[n]] = flat.narrow(0, prm.offset, prm.numel).view(params_[i].sizes()).clone();
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto s = steps[i].item<int64_t>();
    if (s >= 0) out[i]["step"] = torch::tensor({s});
  }
  return out;
}

}  // namespace cohort
