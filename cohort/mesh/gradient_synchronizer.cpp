#include "cohort/mesh/gradient_synchronizer.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <unordered_set>

#include "cohort/core/error.h"
#include "cohort/grad_sync/average_gradients.h"

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
  // The embedding group is the pipeline's, not the mesh's: a split of the PP
  // group, collective over it, made here on every rank of the mesh.
  const int pp = mesh_.size("pp"), stage_index = mesh_.local_rank("pp");
  const bool end = stage_index == 0 || stage_index == pp - 1;
  embedding_group_ = mesh_["pp"].process_group()->split(end ? 0 : -1, stage_index == 0 ? 0 : 1);
  const bool tied = pp > 1 && embedding_group_;
  if (tied && !shared_embedding_.defined()) {
    throw InvalidArgument(who + "the first and last stages need the shared embedding");
  }
  if (tied) {
    // The first stage's copy becomes the last stage's: one model.
    torch::NoGradGuard no_grad;
    auto w = shared_embedding_.detach().contiguous();
    embedding_group_->broadcast(w, {0}).wait();
    shared_embedding_.detach().copy_(w);
  }
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
  all_reduce_grads(*mesh_["tp"].process_group(), sp_params_, options_.tp_algorithm, stats_.tp);
  if (mesh_.size("pp") > 1 && embedding_group_) {
    all_reduce_grads(*embedding_group_, {shared_embedding_}, options_.embedding_algorithm,
                     stats_.pp);
  }
  reduce_experts();
  if (reducer_) {
    const auto& d = reducer_->stats();
    stats_.dp.ops += d.buckets;
    stats_.dp.bytes += d.bytes;
    stats_.dp.seconds += d.comm_seconds;
  }
  ++stats_.steps;
}

void GradientSynchronizer::synchronize() {
  if (reducer_) reducer_->synchronize();
  deferred_ = false;
  reduce_now();
}

}  // namespace cohort
