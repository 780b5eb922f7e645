// A tensor-parallel layer of one's own, implementing TensorParallelModule
// (a column-split weight, no bias), next to a RowParallelLinear and alone,
// at tp = 1, 2, 3 (ranks as threads): everything that reads the layout
// through the interface treats it as cohort's own layers. split_dims names
// its weight; the mesh's gradient norm and the norm of a wiring that trains
// TP layers without a mesh (TrainerWiring::all_reduce over "dp") equal one
// process's norm of the same model (within 1e-6 relative: float32 gradients
// summed in another order), and that wiring refuses it when it says it is
// sequence-parallel; dcp::get_state_dict gives its weight the whole model's
// shape, and a checkpoint saved at tp loads into tp = 1 and into tp with
// every row of the saving model's tensors.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <mutex>

#include "cohort/dcp/dcp.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/mesh/tensor_parallel_module.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/mappings.h"
#include "cohort/wiring/mesh_wiring.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"

namespace cohort::testing::custom_layer_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kHidden = 4, kFeatures = 6;  // 6 divides by 1, 2 and 3
constexpr uint64_t kRowSeed = 3;

// The full weight of the layer below, [kFeatures, kHidden], from `seed`.
torch::Tensor own_full_weight(uint64_t seed) {
  return torch::randn({kFeatures, kHidden}, at::detail::createCPUGenerator(seed));
}

// y = x W^T with W's rows (the output features) split over the TP group;
// with `gather` the outputs are all-gathered, else each rank keeps its own.
struct OwnColumnImpl : torch::nn::Module, TensorParallelModule {
  OwnColumnImpl(std::shared_ptr<Communicator> group, const torch::Tensor& full, bool gather,
                bool sequence_parallel = false)
      : group_(std::move(group)), gather_(gather), sequence_parallel_(sequence_parallel) {
    weight = register_parameter(
        "weight", split_along(full, 0, group_->rank(), group_->size(), "OwnColumn").clone());
    mark_tensor_parallel_split(*this, *group_);
  }
  std::vector<TensorParallelSplit> tensor_parallel_splits() const override { return {{weight, 0}}; }
  std::shared_ptr<Communicator> tensor_parallel_group() const override { return group_; }
  bool sequence_parallel() const override { return sequence_parallel_; }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::linear(copy_to_tensor_parallel_region(x, *group_), weight);
    return gather_ ? gather_from_tensor_parallel_region(y, *group_) : y;
  }
  torch::Tensor weight;

 private:
  std::shared_ptr<Communicator> group_;
  bool gather_, sequence_parallel_;
};
TORCH_MODULE(OwnColumn);

// LayerNorm -> the layer above -> relu, then a RowParallelLinear back to
// kHidden (`with_row`), or the gathered features as they are.
struct NetImpl : torch::nn::Module {
  NetImpl(const DeviceMesh& tp, uint64_t seed, bool with_row) {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
    own = register_module("own", OwnColumn(tp.process_group(), own_full_weight(seed), !with_row));
    if (with_row) {
      RowParallelLinearOptions o;
      o.seed = kRowSeed;
      out = register_module("out", RowParallelLinear(tp, kFeatures, kHidden, o));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(own(ln(x)));
    return out ? out(h) : h;
  }
  torch::nn::LayerNorm ln{nullptr};
  OwnColumn own{nullptr};
  RowParallelLinear out{nullptr};
};
TORCH_MODULE(Net);

torch::Tensor input() { return torch::randn({5, kHidden}, at::detail::createCPUGenerator(11)); }

// The gradient norm of the same model in one process (plain tensors, the
// loss sum(y^2)), in float64.
double one_process_norm(uint64_t seed, bool with_row) {
  auto w = own_full_weight(seed).requires_grad_();
  auto ln_w = torch::ones({kHidden}).requires_grad_(), ln_b = torch::zeros({kHidden});
  ln_b.requires_grad_();
  std::vector<torch::Tensor> params{w, ln_w, ln_b};
  auto y = torch::relu(torch::linear(torch::layer_norm(input(), {kHidden}, ln_w, ln_b), w));
  if (with_row) {
    auto [rw, rb] = master_linear_weights(kFeatures, kHidden, kRowSeed);
    rw.requires_grad_();
    rb.requires_grad_();
    params.push_back(rw);
    params.push_back(rb);
    y = torch::linear(y, rw, rb);
  }
  y.pow(2).sum().backward();
  double squares = 0;
  for (const auto& p : params) squares += p.grad().to(torch::kFloat64).pow(2).sum().item<double>();
  return std::sqrt(squares);
}

DeviceMesh mesh_of(std::shared_ptr<Communicator> world, int tp) {
  return init_device_mesh(std::move(world), {1, 1, tp}, {"pp", "dp", "tp"});
}

class CustomTensorParallelLayer : public ::testing::TestWithParam<int> {};

TEST_P(CustomTensorParallelLayer, SplitDimsNamesItsWeight) {
  const int tp = GetParam();
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, tp);
    Net net(mesh["tp"], 5, /*with_row=*/true);
    const auto dims = split_dims(*net);
    auto dim_of = [&](const torch::Tensor& t) {
      const auto it = dims.find(t.unsafeGetTensorImpl());
      return it == dims.end() ? int64_t{-1} : it->second;
    };
    EXPECT_EQ(dim_of(net->own->weight), tp > 1 ? 0 : -1);
    EXPECT_EQ(dim_of(net->out->weight), tp > 1 ? 1 : -1);
    EXPECT_EQ(dim_of(net->ln->weight), -1);
    EXPECT_EQ(dims.size(), tp > 1 ? 2u : 0u);
  });
}

// One forward and backward of sum(y^2) through the mesh's synchronizer:
// MeshGradNorm counts the layer's rows on every TP rank, the replicated
// LayerNorm and row bias on TP rank 0 only.
TEST_P(CustomTensorParallelLayer, MeshGradNormIsOneProcesssNorm) {
  const int tp = GetParam();
  const double want = one_process_norm(5, /*with_row=*/true);
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, tp);
    Net net(mesh["tp"], 5, /*with_row=*/true);
    cohort::GradientSynchronizer sync(mesh, net.ptr(), {}, torch::Tensor());
    sync.prepare_forward();
    auto y = net(input());
    sync.after_forward({y});
    y.pow(2).sum().backward();
    sync.finish_backward();
    MeshGradNorm norm(mesh, *net, {});
    EXPECT_NEAR(norm.global_norm(net->parameters()), want, 1e-6 * want) << "rank " << world->rank();
  });
}

// A model whose only TP layer is one's own: TrainerWiring::all_reduce over
// the mesh's "dp" finds its group through the interface and brings the norm
// that counts its rows on every TP rank (the Trainer takes
// ReplicatedGradNorm when the layout brings none).
TEST_P(CustomTensorParallelLayer, WiringNormIsOneProcesssNorm) {
  const int tp = GetParam();
  const double want = one_process_norm(5, /*with_row=*/false);
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, tp);
    Net net(mesh["tp"], 5, /*with_row=*/false);
    torch::optim::SGD opt(net->parameters(), 0.1);
    auto wiring = TrainerWiring::all_reduce(net.ptr(), opt, mesh["dp"].process_group());
    net(input()).pow(2).sum().backward();
    auto layout_norm = wiring.layout().norm();
    const double got = layout_norm ? layout_norm->global_norm(net->parameters())
                                   : ReplicatedGradNorm().global_norm(net->parameters());
    // Over one rank the layer is a plain one, and the default norm is right.
    if (tp > 1) {
      EXPECT_NE(layout_norm, nullptr) << "rank " << world->rank();
    }
    EXPECT_NEAR(got, want, 1e-6 * want) << "rank " << world->rank();
  });
}

// A layer of one's own that says it is sequence-parallel: the wirings that
// train TP layers without a mesh refuse it on every rank, naming it, as they
// refuse cohort's (only the mesh's synchronizer sums the partial gradients).
TEST(CustomTensorParallelLayerRefusal, SequenceParallelIsRefusedByTheWiring) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, 2);
    torch::nn::Sequential seq(OwnColumn(mesh["tp"].process_group(), own_full_weight(5), true,
                                        /*sequence_parallel=*/true));
    torch::optim::SGD opt(seq->parameters(), 0.1);
    try {
      TrainerWiring::all_reduce(seq.ptr(), opt, mesh["dp"].process_group());
      ADD_FAILURE() << "rank " << world->rank() << ": not refused";
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("'model.0' is sequence-parallel"), std::string::npos) << what;
    }
  });
}

// Saved at tp from a model drawn with one seed, loaded into models drawn
// with another at tp = 1 and at tp: every row of both layers' weights is the
// saving model's, and the state dict names the whole model's shapes.
TEST_P(CustomTensorParallelLayer, CheckpointHoldsEveryRow) {
  const int tp = GetParam();
  TempDir dir("cohort-custom-tp");
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, tp);
    Net net(mesh["tp"], 5, /*with_row=*/true);
    dcp::StateDictOptions options;
    options.mesh = &mesh;
    const auto state = dcp::get_state_dict(*net, options);
    for (const auto& e : state.tensors) {
      if (e.fqn == "model.own.weight") {
        EXPECT_EQ(e.shape, (std::vector<int64_t>{kFeatures, kHidden})) << "rank " << mesh.rank();
      }
      if (e.fqn == "model.out.weight") {
        EXPECT_EQ(e.shape, (std::vector<int64_t>{kHidden, kFeatures})) << "rank " << mesh.rank();
      }
    }
    dcp::save(state, dir.path(), *world);
  });
  const auto own = own_full_weight(5);
  const auto row = master_linear_weights(kFeatures, kHidden, kRowSeed).first;
  const auto meta = dcp::read_metadata(dir.path());
  EXPECT_TRUE(torch::equal(dcp::read_tensor(dir.path(), meta, "model.own.weight"), own));
  for (int to : {1, tp}) {
    std::mutex mu;
    run_ranks_shared(to, [&](std::shared_ptr<Communicator> world) {
      torch::set_num_threads(1);
      auto mesh = mesh_of(world, to);
      Net net(mesh["tp"], 99, /*with_row=*/true);  // other weights
      dcp::StateDictOptions options;
      options.mesh = &mesh;
      auto state = dcp::get_state_dict(*net, options);
      dcp::load(state, dir.path(), *world);
      dcp::set_state_dict(*net, state, options);
      const int r = mesh.local_rank("tp");
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_TRUE(torch::equal(net->own->weight, split_along(own, 0, r, to, "own")))
          << "tp " << tp << " -> " << to << ", rank " << r;
      EXPECT_TRUE(torch::equal(net->out->weight, split_along(row, 1, r, to, "row")))
          << "tp " << tp << " -> " << to << ", rank " << r;
    });
  }
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, CustomTensorParallelLayer, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "tp" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::custom_layer_test
