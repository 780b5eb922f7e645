#include "cohort/mesh/gradient_synchronizer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <unordered_set>

#include "cohort/core/error.h"
#include "cohort/grad_sync/average_gradients.h"
#include "cohort/mesh/tp_replicas.h"

namespace cohort {

namespace {

// all_reduce(Avg) of a DP bucket with a chosen algorithm.
class AlgorithmAllReduceHook : public CommHook {
 public:
  explicit AlgorithmAllReduceHook(Algorithm algo) : algo_(algo) {}
  Work run(Communicator& comm, GradBucket& bucket) override {
    AllReduceOptions o;
    o.op = ReduceOp::Avg;
    o.algo = algo_;
    return comm.all_reduce(bucket.buffer, o);
  }
  std::string name() const override { return "all_reduce(" + to_string(algo_) + ")"; }

 private:
  Algorithm algo_;
};

bool has_dimension(const DeviceMesh& mesh, const std::string& name) {
  const auto names = mesh.dim_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

// The sub-mesh group over `wanted` dimensions of the mesh ("dp" always, the
// others where they are above size 1), in the mesh's order.
std::shared_ptr<Communicator> group_over(const DeviceMesh& mesh,
                                         const std::vector<std::string>& wanted) {
  std::vector<std::string> names;
  for (const auto& name : mesh.dim_names()) {
    if (std::find(wanted.begin(), wanted.end(), name) == wanted.end()) continue;
    if (name == "dp" || mesh.size(name) > 1) names.push_back(name);
  }
  return names.size() == 1 ? mesh[names[0]].process_group() : mesh[names].process_group();
}

// The non-expert parameters (and the buffers) of a stage, as a module of
// their own: the DDP reducer buckets a module's parameters, and the experts
// must stay out of its average over the dense group.
std::shared_ptr<torch::nn::Module> without(const torch::nn::Module& stage,
                                           const std::vector<torch::Tensor>& experts) {
  std::unordered_set<const void*> skip;
  for (const auto& t : experts) skip.insert(t.unsafeGetTensorImpl());
  auto holder = std::make_shared<torch::nn::Module>("DenseParameters");
  int i = 0;
  for (const auto& p : stage.parameters()) {
    if (skip.count(p.unsafeGetTensorImpl())) continue;
    holder->register_parameter("p" + std::to_string(i++), p, p.requires_grad());
  }
  i = 0;
  for (const auto& b : stage.buffers()) holder->register_buffer("b" + std::to_string(i++), b);
  return holder;
}

double sync_seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

GradientSynchronizer::GradientSynchronizer(DeviceMesh mesh,
                                           std::shared_ptr<torch::nn::Module> stage,
                                           std::vector<torch::Tensor> sp_params,
                                           torch::Tensor shared_embedding,
                                           GradientSynchronizerOptions options)
    : mesh_(std::move(mesh)),
      sp_params_(std::move(sp_params)),
      shared_embedding_(std::move(shared_embedding)),
      options_(std::move(options)) {
  const std::string who =
      "cohort: GradientSynchronizer (rank " + std::to_string(mesh_.rank()) + "): ";
  if (!stage) throw InvalidArgument(who + "null stage");
  check_dimensions(who);
  std::unordered_set<const void*> mine;
  for (const auto& p : stage->parameters()) mine.insert(p.unsafeGetTensorImpl());
  for (const auto& p : options_.expert_parameters) {
    if (!p.defined() || !mine.count(p.unsafeGetTensorImpl())) {
      throw InvalidArgument(who + "an expert parameter is not a parameter of the stage");
    }
  }
  collect_sequence_parallel(*stage, who);
  collect_tp_replicas(*stage);
  // The embedding group is the pipeline's, not the mesh's: the ranks of
  // this rank's "pp" group holding a copy (the first and the last stage),
  // made with the copies equal (the first stage's), collective over it.
  const int pp = mesh_.size("pp"), stage_index = mesh_.local_rank("pp");
  const bool end = stage_index == 0 || stage_index == pp - 1;
  if (pp > 1) check_embedding_tie(end, who);
  if (!end) shared_embedding_ = torch::Tensor();  // a middle stage holds no end of the tie
  // Untied (pp > 1): no rank holds a copy, so no group and nothing summed.
  std::vector<torch::Tensor> copies;
  const bool untied = pp > 1 && options_.untied_embedding;
  if (end && !untied && (pp > 1 || shared_embedding_.defined())) {
    copies.push_back(shared_embedding_);
  }
  embedding_ = std::make_unique<TiedCopies>(*mesh_["pp"].process_group(), std::move(copies),
                                            "shared embedding", who);
  embedding_group_ = embedding_->group();
  build_groups();
  if (dense_->size() > 1) {
    if (!options_.expert_parameters.empty()) {
      dense_module_ = without(*stage, options_.expert_parameters);
    }
    reducer_ = std::make_unique<GradientReducer>(dense_module_ ? dense_module_ : stage, dense_,
                                                 options_.ddp);
    reducer_->register_comm_hook(
        options_.dp_comm_hook ? options_.dp_comm_hook
                              : std::make_shared<AlgorithmAllReduceHook>(options_.dp_algorithm));
  }
  // After the DP reducer's broadcast, which makes every dense peer's values
  // DP rank 0's, so that they reach the same verdict.
  if (options_.verify_tp_replicas && mesh_.size("tp") > 1) check_tp_replica_values(who);
}

GradientSynchronizer::~GradientSynchronizer() = default;

void GradientSynchronizer::check_dimensions(const std::string& who) const {
  for (const char* needed : {"pp", "dp", "tp"}) {
    if (!has_dimension(mesh_, needed)) {
      throw InvalidArgument(who + "the mesh (" + mesh_.to_string() + ") has no dimension '" +
                            needed + "'");
    }
  }
  for (const auto& name : mesh_.dim_names()) {
    if (name != "pp" && name != "dp" && name != "tp" && name != "ep" && name != "cp" &&
        mesh_.size(name) > 1) {
      throw InvalidArgument(who + "reduces over pp, dp, tp, ep and cp only; dimension '" + name +
                            "' of the mesh (" + mesh_.to_string() + ") would be left unreduced");
    }
  }
  // Without the expert list every parameter would be averaged over "ep",
  // which mixes the gradients of different experts: a silent wrong model.
  if (has_dimension(mesh_, "ep") && mesh_.size("ep") > 1 && options_.expert_parameters.empty()) {
    throw InvalidArgument(who + "the mesh (" + mesh_.to_string() +
                          ") splits experts over ep, but options.expert_parameters is empty");
  }
}

void GradientSynchronizer::check_embedding_tie(bool end_stage, const std::string& who) const {
  // Per rank: bit 0 an end stage, bit 1 it passed an embedding, bit 2
  // untied_embedding, above them its pipeline stage.
  const int64_t mine = (end_stage ? 1 : 0) | (shared_embedding_.defined() ? 2 : 0) |
                       (options_.untied_embedding ? 4 : 0) | (int64_t{mesh_.local_rank("pp")} << 3);
  auto& world = *mesh_.process_group();
  auto all = torch::empty({world.size()}, torch::kInt64);
  world.all_gather_into_tensor(all, torch::full({1}, mine, torch::kInt64)).wait();
  const auto a = all.accessor<int64_t, 1>();
  auto rank_text = [&](int r) {
    return "mesh rank " + std::to_string(r) + " (pipeline stage " + std::to_string(a[r] >> 3) + ")";
  };
  const bool untied = options_.untied_embedding;
  for (int r = 0; r < world.size(); ++r) {
    if (static_cast<bool>(a[r] & 4) != untied) {
      throw InvalidArgument(who + "options.untied_embedding is " + (untied ? "true" : "false") +
                            " here but " + (untied ? "false" : "true") + " on " + rank_text(r) +
                            ": every rank must build the same model");
    }
  }
  for (int r = 0; r < world.size(); ++r) {
    const bool end = a[r] & 1, passed = a[r] & 2;
    if (end && !untied && !passed) {
      throw InvalidArgument(
          who + rank_text(r) + " passed no shared_embedding: at pp " +
          std::to_string(mesh_.size("pp")) +
          " the first and the last stage of a model whose output layer is the word embedding "
          "(tied) must each pass their copy, whose gradients are summed between them (left "
          "out, the copies would train apart). For a model whose output layer has weights of "
          "its own, set GradientSynchronizerOptions::untied_embedding");
    }
    if (end && untied && passed) {
      throw InvalidArgument(
          who + rank_text(r) +
          " passed a shared_embedding, but options.untied_embedding says the output layer has "
          "weights of its own: pass none (untied), or leave untied_embedding false (tied)");
    }
  }
}

void GradientSynchronizer::collect_sequence_parallel(const torch::nn::Module& stage,
                                                     const std::string& who) {
  std::unordered_set<const void*> mine, experts;
  for (const auto& p : stage.parameters()) mine.insert(p.unsafeGetTensorImpl());
  for (const auto& p : options_.expert_parameters) experts.insert(p.unsafeGetTensorImpl());
  // Frozen parameters are listed too: one unfrozen after construction must
  // be summed like the others (one frozen on every rank keeps no .grad).
  std::vector<torch::Tensor> known;
  auto visit = [&](const torch::nn::Module& m) {
    const auto* tp = dynamic_cast<const TensorParallelModule*>(&m);
    if (!tp) return;
    for (const auto& p : tp->tensor_parallel_split_parameters()) {
      if (p.defined()) tp_split_.insert(p.unsafeGetTensorImpl());
    }
    for (const auto& p : tp->sequence_parallel_parameters()) {
      if (p.defined() && !experts.count(p.unsafeGetTensorImpl())) known.push_back(p);
    }
  };
  visit(stage);
  for (const auto& m : stage.modules(/*include_self=*/false)) visit(*m);
  // A listed tensor outside the stage would be summed over TP while the
  // stage's own parameter stays a partial sum; a TP rank's part of a split
  // tensor or an expert summed over TP would mix different tensors. Every
  // check is local and deterministic, so every rank of one model refuses.
  for (size_t i = 0; i < sp_params_.size(); ++i) {
    const auto& p = sp_params_[i];
    const std::string which = who + "sequence-parallel parameter " + std::to_string(i);
    if (!p.defined()) throw InvalidArgument(which + " is undefined");
    const void* key = p.unsafeGetTensorImpl();
    if (!mine.count(key)) throw InvalidArgument(which + " is not a parameter of the stage");
    if (tp_split_.count(key)) {
      throw InvalidArgument(which +
                            " is split over TP (each TP rank holds a different part), so its "
                            "gradient must not be summed over TP: list only parameters whole on "
                            "every TP rank");
    }
    if (experts.count(key)) {
      throw InvalidArgument(which + " is an expert parameter, reduced over its replicas");
    }
  }
  // The parameters the stage's layers know to be sequence-parallel join the
  // list, each once (summing one twice would multiply it by tp).
  std::unordered_set<const void*> seen;
  std::vector<torch::Tensor> listed = std::move(sp_params_);
  sp_params_.clear();
  listed.insert(listed.end(), known.begin(), known.end());
  for (auto& p : listed) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) sp_params_.push_back(std::move(p));
  }
}

void GradientSynchronizer::collect_tp_replicas(const torch::nn::Module& stage) {
  if (!options_.verify_tp_replicas || mesh_.size("tp") == 1) return;
  tp_replicas_ = tp_replicated_parameters(stage, options_.expert_parameters);
}

namespace {

// The verdicts (0 fine, 1 deferred, 2 refused) of every stage of this rank's
// "pp" group, for a check whose stages check different parameters: one that
// refuses while the next goes on would leave that one waiting for its
// activations until the timeout. One all-gather of a word over "pp".
torch::Tensor stage_verdicts(Communicator& pp, int64_t mine) {
  auto verdicts = torch::full({1}, mine, torch::kInt64);
  if (pp.size() == 1) return verdicts;
  auto all = torch::empty({pp.size()}, torch::kInt64);
  pp.all_gather_into_tensor(all, verdicts).wait();
  return all;
}

void refuse_with_stages(const std::string& who, const std::string& mine,
                        const torch::Tensor& verdicts, const std::string& what) {
  if (!mine.empty()) throw InvalidArgument(who + mine);
  for (int64_t s = 0; s < verdicts.numel(); ++s) {
    if (verdicts[s].item<int64_t>() == 2) {
      throw InvalidArgument(who + "pipeline stage " + std::to_string(s) +
                            " (its rank in this rank's \"pp\" group) found " + what +
                            "; its ranks name the parameter");
    }
  }
}

}  // namespace

void GradientSynchronizer::check_tp_replica_values(const std::string& who) {
  std::string mismatch = tp_replica_values_mismatch(*mesh_["tp"].process_group(), tp_replicas_);
  if (!mismatch.empty()) {
    mismatch += " (or set GradientSynchronizerOptions::verify_tp_replicas = false)";
  }
  const auto verdicts = stage_verdicts(*mesh_["pp"].process_group(), mismatch.empty() ? 0 : 2);
  refuse_with_stages(who, mismatch, verdicts,
                     "a parameter whole on every TP rank whose values differ across TP ranks");
}

std::string GradientSynchronizer::sequence_parallel_already_whole() {
  // Before the TP sum of the first step: a listed parameter whose gradient
  // is the same non-zero tensor on every TP rank saw whole activations, and
  // summing it would multiply it by tp. Partial sums over different parts
  // of the sequence agree bit for bit only by accident.
  if (sp_params_.empty()) return "";
  std::vector<torch::Tensor> grads;
  for (const auto& p : sp_params_) grads.push_back(p.grad());
  auto& tp = *mesh_["tp"].process_group();
  auto table = tp_digests(tp, grads, sp_params_.front().device());
  if (!torch::isfinite(table).all().item<bool>()) return "";
  auto t = table.accessor<double, 3>();
  for (size_t i = 0; i < sp_params_.size(); ++i) {
    bool same = t[0][i][1] > 0;
    for (int r = 1; r < tp.size() && same; ++r) {
      same = t[r][i][0] == t[0][i][0] && t[r][i][1] == t[0][i][1];
    }
    if (!same) continue;
    return "sequence-parallel parameter " + std::to_string(i) +
           " has the same gradient on every TP rank (sum " + std::to_string(t[0][i][0]) +
           "): it sees whole activations, not ones split along the sequence, and summing it over "
           "TP would multiply it by " +
           std::to_string(tp.size()) + ". Leave it out of sequence_parallel_parameters";
  }
  return "";
}

std::string GradientSynchronizer::tp_replica_mismatch(bool& deferred) {
  deferred = false;
  if (tp_replicas_.empty()) return "";
  std::vector<torch::Tensor> grads;
  for (const auto& named : tp_replicas_) grads.push_back(named.second.grad());
  auto& tp = *mesh_["tp"].process_group();
  auto table = tp_digests(tp, grads, tp_replicas_.front().second.device());
  // An overflowed step (inf or NaN gradients, which a loss scaler skips)
  // proves nothing either way: every TP rank sees the same table.
  if (!torch::isfinite(table).all().item<bool>()) {
    deferred = true;
    return "";
  }
  auto t = table.accessor<double, 3>();
  for (int64_t i = 0; i < table.size(1); ++i) {
    double scale = 0;
    for (int r = 0; r < tp.size(); ++r) scale = std::max(scale, t[r][i][1]);
    for (int r = 1; r < tp.size(); ++r) {
      if (std::abs(t[r][i][0] - t[0][i][0]) <= 1e-5 * scale &&
          std::abs(t[r][i][1] - t[0][i][1]) <= 1e-5 * scale) {
        continue;
      }
      return "the gradient of parameter '" + tp_replicas_[static_cast<size_t>(i)].first +
             "', whole on every TP rank, differs across TP ranks (sum " +
             std::to_string(t[0][i][0]) + " on tp rank 0, " + std::to_string(t[r][i][0]) +
             " on tp rank " + std::to_string(r) +
             "): its TP replicas would drift apart. If it sees activations split along the "
             "sequence over TP, list it in sequence_parallel_parameters; if a layer of your own "
             "splits it over TP, implement TensorParallelModule in that layer (or set "
             "GradientSynchronizerOptions::verify_tp_replicas = false)";
    }
  }
  return "";
}

void GradientSynchronizer::verify_tp_replicas(const std::string& before_sum) {
  // Every DP, CP and EP peer holds the same reduced gradients, so they reach
  // the same verdict; the stages agree on theirs (once).
  bool deferred = false;
  const std::string mismatch = !before_sum.empty() ? before_sum : tp_replica_mismatch(deferred);
  const int64_t mine = !mismatch.empty() ? 2 : deferred ? 1 : 0;
  const auto verdicts = stage_verdicts(*mesh_["pp"].process_group(), mine);
  const std::string who = "cohort: GradientSynchronizer (rank " + std::to_string(mesh_.rank()) +
                          "): after the reduction, ";
  refuse_with_stages(who, mismatch, verdicts,
                     "a parameter whole on every TP rank whose gradient differs across TP "
                     "ranks, or a sequence-parallel one whose gradient does not");
  tp_verified_ = verdicts.max().item<int64_t>() == 0;
}

void GradientSynchronizer::build_groups() {
  // Collective over the mesh (a combination's first split), in the same
  // order on every rank.
  dense_ = group_over(mesh_, {"dp", "ep", "cp"});
  replicas_ = group_over(mesh_, {"dp", "cp"});
}

void GradientSynchronizer::reduce_experts() {
  const auto& experts = options_.expert_parameters;
  if (experts.empty() || dense_->size() == 1) return;
  // Each rank's expert gradient already sums the tokens of its whole ep
  // group; the loss is the mean over the dense group, so the sum over the
  // replicas is divided by the dense group's size (not the replicas').
  all_reduce_grads(*replicas_, experts, options_.dp_algorithm, stats_.experts);
  torch::NoGradGuard no_grad;
  const double scale = 1.0 / dense_->size();
  for (const auto& p : experts) {
    if (p.grad().defined()) p.mutable_grad().mul_(scale);
  }
}

void GradientSynchronizer::prepare_forward() {
  deferred_ = no_sync_depth_ > 0 || (reducer_ && reducer_->no_sync_depth() > 0);
  if (reducer_) reducer_->prepare_forward();
}

void GradientSynchronizer::push_no_sync() {
  ++no_sync_depth_;
  if (reducer_) reducer_->push_no_sync();
}

void GradientSynchronizer::pop_no_sync() {
  --no_sync_depth_;
  if (reducer_) reducer_->pop_no_sync();
}

void GradientSynchronizer::after_forward(const std::vector<torch::Tensor>& outputs) {
  if (reducer_) reducer_->after_forward(outputs);
}

void GradientSynchronizer::all_reduce_grads(Communicator& group,
                                            const std::vector<torch::Tensor>& params,
                                            Algorithm algo, DimensionStats& stats) {
  if (params.empty() || group.size() == 1) return;
  const auto t0 = std::chrono::steady_clock::now();
  // As the DP average: a parameter without a gradient on some ranks takes
  // part as zeros there, one without on every rank (unused, or frozen) keeps
  // an undefined .grad, as in one process.
  AllReduceOptions o;
  o.algo = algo;
  stats.bytes += reduce_gradients(params, group, o);
  stats.ops += 1;
  stats.seconds += sync_seconds_since(t0);
}

void GradientSynchronizer::finish_backward() {
  // Under no_sync() the gradients are one rank's partial sums, to which the
  // next micro-batches add: reducing them now and again with the next
  // micro-batch's would count this one's tp (or 2, or dp x cp) times.
  if (deferred_) return;
  reduce_now();
}

void GradientSynchronizer::reduce_now() {
  const bool verify = !tp_verified_ && options_.verify_tp_replicas && mesh_.size("tp") > 1;
  const std::string before_sum = verify ? sequence_parallel_already_whole() : "";
  all_reduce_grads(*mesh_["tp"].process_group(), sp_params_, options_.tp_algorithm, stats_.tp);
  if (mesh_.size("pp") > 1 && embedding_group_) {
    const auto t0 = std::chrono::steady_clock::now();
    AllReduceOptions o;
    o.algo = options_.embedding_algorithm;
    stats_.pp.bytes += embedding_->sum_gradients(o);
    stats_.pp.ops += 1;
    stats_.pp.seconds += sync_seconds_since(t0);
  }
  reduce_experts();
  if (verify) verify_tp_replicas(before_sum);
  if (reducer_) {
    const auto& d = reducer_->stats();
    stats_.dp.ops += d.buckets;
    stats_.dp.bytes += d.bytes;
    stats_.dp.seconds += d.comm_seconds;
  }
  ++stats_.steps;
}

void GradientSynchronizer::synchronize(const std::exception_ptr& failed) {
  try {
    if (reducer_) {
      reducer_->synchronize(failed);
    } else if (failed) {
      std::rethrow_exception(failed);
    }
  } catch (...) {
    for (const auto& p : options_.expert_parameters) p.mutable_grad() = torch::Tensor();
    throw;
  }
  deferred_ = false;
  reduce_now();
}

}  // namespace cohort
