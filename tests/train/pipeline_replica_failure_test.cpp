// A stage's code that throws in one data-parallel replica of a pipeline
// (TrainerWiring::pipeline with dp > 1, TrainerWiring::mesh): every rank of
// every replica throws a StageError naming the stage, its rank and the
// micro-batch within the step, never a wait in the data-parallel average
// for its timeout; no replica takes the optimizer step, and the next step
// trains from the unchanged weights on every replica.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <ostream>

#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline_replica_failure_test {
namespace {

using pipeline::Tensors;

constexpr int64_t kWidth = 4, kMicro = 2;
constexpr int kM = 2;  // micro-batches per step
constexpr auto kTimeout = std::chrono::seconds(4);

// Where replica c.replica's step 0 fails: a stage's forward, the loss
// function or a backward hook throws, or its batch is one column wider than
// the model takes (its first Linear throws).
enum class Where { Forward, Loss, Backward, BadShape };

const char* where_name(Where w) {
  switch (w) {
    case Where::Forward:
      return "Forward";
    case Where::Loss:
      return "Loss";
    case Where::Backward:
      return "Backward";
    case Where::BadShape:
      return "BadShape";
  }
  return "?";
}

// The stage that throws and its micro-batch: stage 1 (stage 0 at pp 1) at
// micro-batch 1, the last stage's loss, or stage 0 at micro-batch 0.
int failing_stage(Where w, int stages) {
  if (w == Where::BadShape) return 0;
  return w == Where::Loss ? stages - 1 : std::min(1, stages - 1);
}
int failing_micro_batch(Where w) { return w == Where::BadShape ? 0 : 1; }

struct Case {
  const char* schedule;  // make_schedule's names
  int pp, dp;
  Where where;
  int replica;  // the failing one
  bool mesh;    // TrainerWiring::mesh with a GradientSynchronizer, else ::pipeline
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.schedule; }

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.schedule) + "_pp" + std::to_string(c.pp) + "_dp" + std::to_string(c.dp) +
         "_" + where_name(c.where) + "_replica" + std::to_string(c.replica) +
         (c.mesh ? "_mesh" : "");
}

torch::Tensor det(std::vector<int64_t> shape, double phase) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return torch::sin(torch::arange(n, torch::kFloat32) * 0.37 + phase).reshape(shape) * 0.5;
}

torch::nn::Sequential make_model(int stages) {
  torch::nn::Sequential seq;
  torch::NoGradGuard no_grad;
  for (int s = 0; s < stages; ++s) {
    torch::nn::Linear lin(kWidth, kWidth);
    lin->weight.copy_(det({kWidth, kWidth}, s));
    lin->bias.copy_(det({kWidth}, 10 + s));
    seq->push_back(lin);
    seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

// Step `step`'s rows of replica `replica`: its m micro-batches, one column
// too wide when `wide`.
std::vector<torch::data::Example<>> batches(const torch::Tensor& x, const torch::Tensor& y, int dp,
                                            int step, int replica, bool wide = false) {
  std::vector<torch::data::Example<>> out;
  for (int mb = 0; mb < kM; ++mb) {
    const int64_t at = ((step * dp + replica) * kM + mb) * kMicro;
    auto data = x.narrow(0, at, kMicro);
    if (wide) data = torch::cat({data, data.narrow(1, 0, 1)}, 1);
    out.push_back({data, y.narrow(0, at, kMicro)});
  }
  return out;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

struct Seen {
  std::string what = "no error";
  bool stage_error = false;
  double seconds = 0;
  double next_loss = -1;   // the step after the failed one
  bool unchanged = false;  // the weights after the failed step are the initial ones
};

Seen run_rank(const Case& c, std::shared_ptr<Communicator> world, const torch::Tensor& x,
              const torch::Tensor& y) {
  torch::set_num_threads(1);
  const int v = std::string(c.schedule) == "interleaved" ? 2 : 1, stages = c.pp * v;
  const int pp_rank = world->rank() % c.pp, replica = world->rank() / c.pp;
  const int failing = failing_stage(c.where, stages);
  const bool armed_here = replica == c.replica;
  auto mesh = init_device_mesh(world, {c.dp, c.pp, 1}, {"dp", "pp", "tp"});
  auto model = make_model(stages);
  const auto schedule = pipeline::make_schedule(c.schedule, c.pp, v, kM);
  std::vector<int64_t> boundaries;
  for (int s = 1; s < stages; ++s) boundaries.push_back(2 * s);
  auto armed = std::make_shared<bool>(armed_here);
  std::vector<pipeline::PipelineStage> mine;
  auto held = std::make_shared<torch::nn::Module>();  // this rank's stages, for the synchronizer
  for (int s : schedule.stages_of(pp_rank)) {
    auto layers = pipeline::split_sequential(model, boundaries, s);
    held->register_module("stage" + std::to_string(s), layers.ptr());
    if (s != failing || c.where == Where::Loss || c.where == Where::BadShape) {
      mine.emplace_back(s, layers);
      continue;
    }
    auto calls = std::make_shared<int>(0);
    mine.emplace_back(
        s,
        [layers, calls, armed, where = c.where](const Tensors& in) mutable {
          const bool now = *armed && (*calls)++ == 1;
          if (now && where == Where::Forward) {
            *armed = false;
            throw std::runtime_error("boom");
          }
          auto out = layers->forward(in[0]);
          if (now) {
            *armed = false;
            out.register_hook(
                [](torch::Tensor) -> torch::Tensor { throw std::runtime_error("boom"); });
          }
          return Tensors{out * 1.0};
        },
        layers->parameters(), layers.ptr());
  }
  auto loss_calls = std::make_shared<int>(0);
  pipeline::PipelineLossFn loss = [armed, loss_calls, where = c.where](const Tensors& out,
                                                                       const Tensors& t) {
    if (where == Where::Loss && *armed && (*loss_calls)++ == 1) {
      *armed = false;
      throw std::runtime_error("boom");
    }
    return torch::nn::functional::mse_loss(out[0], t[0]);
  };
  pipeline::PipelineOptions po;
  po.timeout = kTimeout;
  pipeline::PipelineRuntime rt(mesh["pp"], std::move(mine), schedule, loss, po);
  const auto initial = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& p : rt.parameters()) out.push_back(p.detach().clone());
    return out;
  }();
  torch::optim::SGD opt(rt.parameters(), torch::optim::SGDOptions(0.1));
  GradientSynchronizerOptions so;
  so.untied_embedding = true;
  std::unique_ptr<GradientSynchronizer> sync;
  if (c.mesh)
    sync = std::make_unique<GradientSynchronizer>(mesh, held, Tensors{}, torch::Tensor{}, so);
  auto wiring = c.mesh     ? TrainerWiring::mesh(mesh, rt, opt, *sync)
                : c.dp > 1 ? TrainerWiring::pipeline(rt, opt, mesh)
                           : TrainerWiring::pipeline(rt, opt);
  TrainerOptions config;
  config.accumulation_steps = kM;
  config.schedule.base_lr = 0.1;
  config.progress = false;
  Trainer trainer(std::move(wiring), config);
  Seen seen;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    trainer.train_step(batches(x, y, c.dp, 0, replica, c.where == Where::BadShape && armed_here));
  } catch (const std::exception& e) {
    seen.what = e.what();
    seen.stage_error = dynamic_cast<const StageError*>(&e) != nullptr;
  }
  seen.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  seen.unchanged = true;
  for (size_t i = 0; i < initial.size(); ++i)
    seen.unchanged = seen.unchanged && torch::equal(initial[i], rt.parameters()[i].detach());
  try {
    seen.next_loss = trainer.train_step(batches(x, y, c.dp, 1, replica)).loss;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << world->rank() << ", the step after: " << e.what();
  }
  return seen;
}

class PipelineReplicaFailure : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineReplicaFailure, EveryRankOfEveryReplicaThrowsWithinTheStep) {
  const Case c = GetParam();
  const int world = c.pp * c.dp;
  const auto x = det({2 * c.dp * kM * kMicro, kWidth}, 0.3);
  const auto y = det({2 * c.dp * kM * kMicro, kWidth}, 1.1);
  // Step 1's loss from the initial weights: no replica stepped at step 0.
  auto ref_model = make_model(c.pp * (std::string(c.schedule) == "interleaved" ? 2 : 1));
  const int64_t global = c.dp * kM * kMicro;
  const double ref_loss =
      torch::nn::functional::mse_loss(ref_model->forward(x.narrow(0, global, global)),
                                      y.narrow(0, global, global))
          .item<double>();
  std::vector<Seen> seen(static_cast<size_t>(world));
  // Open until every rank is done: a rank that threw must not end the
  // others' waits by closing its connections.
  std::vector<std::shared_ptr<Communicator>> keep(static_cast<size_t>(world));
  std::mutex mu;
  testing::ThreadRanksOptions options;
  options.timeout = kTimeout;
  testing::run_ranks_shared(
      world,
      [&](std::shared_ptr<Communicator> comm) {
        keep[static_cast<size_t>(comm->rank())] = comm;
        Seen s = run_rank(c, comm, x, y);
        std::lock_guard<std::mutex> lock(mu);
        seen[static_cast<size_t>(comm->rank())] = std::move(s);
      },
      options);
  const int v = std::string(c.schedule) == "interleaved" ? 2 : 1;
  const int failing = failing_stage(c.where, c.pp * v);
  double slowest = 0;
  for (int r = 0; r < world; ++r) {
    const Seen& s = seen[static_cast<size_t>(r)];
    slowest = std::max(slowest, s.seconds);
    EXPECT_TRUE(s.stage_error) << "rank " << r << ": " << s.what;
    EXPECT_TRUE(has(s.what, "stage " + std::to_string(failing))) << s.what;
    EXPECT_TRUE(has(s.what, "micro-batch " + std::to_string(failing_micro_batch(c.where))))
        << s.what;
    EXPECT_TRUE(has(s.what, c.where == Where::BadShape ? "shapes cannot be multiplied" : "boom"))
        << s.what;
    EXPECT_LT(s.seconds, 0.5 * kTimeout.count()) << "rank " << r << ": " << s.what;
    EXPECT_TRUE(s.unchanged) << "rank " << r << " took an optimizer step";
    EXPECT_NEAR(s.next_loss, ref_loss, 1e-5 * ref_loss) << "rank " << r;
  }
  // What the other replicas read.
  const int other = c.replica == 0 && c.dp > 1 ? c.pp : 0;
  std::cout << "slowest rank threw after " << slowest << " s; rank " << other << ": "
            << seen[static_cast<size_t>(other)].what << "\n";
}

// SGD whose step throws once when armed.
class ThrowingSGD : public torch::optim::SGD {
 public:
  ThrowingSGD(std::vector<torch::Tensor> params, bool armed)
      : torch::optim::SGD(std::move(params), torch::optim::SGDOptions(0.1)), armed_(armed) {}
  torch::Tensor step(LossClosure closure = nullptr) override {
    if (armed_) {
      armed_ = false;
      throw std::runtime_error("optimizer boom");
    }
    return torch::optim::SGD::step(std::move(closure));
  }

 private:
  bool armed_;
};

// The optimizer step throws on one rank (the last stage's rank of replica
// 0, pp 2 x dp 2): the others, which took theirs, would wait in the step's
// loss all-reduce. Every rank throws within the step, naming that rank and
// its message, and says the replicas may now differ.
TEST(PipelineReplicaOptimizerFailure, EveryRankThrowsWithinTheStep) {
  constexpr int kPp = 2, kDp = 2;
  const auto x = det({kDp * kM * kMicro, kWidth}, 0.3), y = det({kDp * kM * kMicro, kWidth}, 1.1);
  std::vector<std::string> what(kPp * kDp, "no error");
  std::vector<double> seconds(kPp * kDp, 0);
  std::vector<std::shared_ptr<Communicator>> keep(kPp * kDp);  // as above
  testing::ThreadRanksOptions options;
  options.timeout = kTimeout;
  testing::run_ranks_shared(
      kPp * kDp,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        const int r = world->rank(), pp_rank = r % kPp, replica = r / kPp;
        keep[static_cast<size_t>(r)] = world;
        auto mesh = init_device_mesh(world, {kDp, kPp}, {"dp", "pp"});
        auto model = make_model(kPp);
        const auto schedule = pipeline::make_schedule("1f1b", kPp, 1, kM);
        std::vector<pipeline::PipelineStage> mine;
        mine.emplace_back(pp_rank, pipeline::split_sequential(model, {2}, pp_rank));
        auto mse = [](const Tensors& out, const Tensors& t) {
          return torch::nn::functional::mse_loss(out[0], t[0]);
        };
        pipeline::PipelineRuntime rt(mesh["pp"], std::move(mine), schedule, mse);
        ThrowingSGD opt(rt.parameters(), r == 1);
        TrainerOptions config;
        config.accumulation_steps = kM;
        config.schedule.base_lr = 0.1;
        config.progress = false;
        Trainer trainer(TrainerWiring::pipeline(rt, opt, mesh), config);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          trainer.train_step(batches(x, y, kDp, 0, replica));
        } catch (const std::exception& e) {
          what[static_cast<size_t>(r)] = e.what();
        }
        seconds[static_cast<size_t>(r)] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      },
      options);
  for (int r = 0; r < kPp * kDp; ++r) {
    EXPECT_TRUE(has(what[r], "optimizer boom")) << "rank " << r << ": " << what[r];
    if (r != 1) {
      EXPECT_TRUE(has(what[r], "rank 1")) << what[r];
    }
    EXPECT_LT(seconds[r], 0.5 * kTimeout.count()) << "rank " << r << ": " << what[r];
  }
  std::cout << "slowest rank threw after " << *std::max_element(seconds.begin(), seconds.end())
            << " s; rank 0: " << what[0] << "\n";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* s : {"gpipe", "1f1b", "interleaved", "zbh1"})
    for (Where w : {Where::Forward, Where::Loss, Where::Backward})
      for (int replica : {0, 1}) out.push_back({s, 2, 2, w, replica, false});
  for (const char* s : {"1f1b", "zbh1"})
    for (Where w : {Where::Forward, Where::Loss, Where::Backward})
      for (int replica : {0, 1}) out.push_back({s, 2, 2, w, replica, true});
  for (bool mesh : {false, true}) out.push_back({"1f1b", 2, 2, Where::BadShape, 1, mesh});
  for (Where w : {Where::Forward, Where::Loss, Where::Backward, Where::BadShape}) {
    out.push_back({"1f1b", 2, 1, w, 0, false});
    out.push_back({"1f1b", 1, 3, w, 1, false});
    out.push_back({"1f1b", 1, 3, w, 2, true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Trainer, PipelineReplicaFailure, ::testing::ValuesIn(cases()), name_of);

}  // namespace
}  // namespace cohort::pipeline_replica_failure_test
