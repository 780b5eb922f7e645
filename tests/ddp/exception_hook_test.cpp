// A backward that throws after some buckets were launched, under a
// stateful comm hook (top-k and int8 with error feedback, PowerSGD with
// error feedback and warm start), on every rank at the same call, ranks as
// threads over Gloo and UCX at world 1 to 3. The hook reduced the launched
// buckets of the failed step and folded that step's gradients into their
// state; the next forward starts those buckets afresh, as a bucket rebuild
// does (Compressor::reset: error feedback and PowerSGD's Q dropped, the
// step counter kept, so it counts the failed step's call), and leaves the
// other buckets' state alone. The reference is the same DDP and hook that
// skips the step and starts the same buckets afresh by hand: after 10
// SGD-with-momentum steps every parameter is bitwise the reference's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/engine_worlds.h"
#include "tests/ddp/ddp_test_models.h"
#include "tests/ddp/failing_mlp.h"

namespace cohort::testing::ddp_exception_hook_test {
namespace {

using namespace failing_mlp;
using compression::CompressionKind;
using Mlp = torch::nn::Sequential;

compression::CompressionOptions options_of(CompressionKind kind) {
  compression::CompressionOptions o;
  o.kind = kind;
  o.error_feedback = true;
  o.topk_ratio = 0.1;
  o.int8_chunk = 16;
  // Compressed from step 2 on: the failed step 3 finds error and Q kept.
  o.powersgd_start_iteration = 2;
  o.powersgd_warm_start = true;
  return o;
}

// A CompressionHook that records which buckets it was handed.
class RecordingHook : public CommHook {
 public:
  explicit RecordingHook(CompressionKind kind)
      : inner_(std::make_shared<CompressionHook>(options_of(kind))) {}
  Work run(Communicator& comm, GradBucket& bucket) override {
    ran.push_back(bucket.index);
    return inner_->run(comm, bucket);
  }
  std::string name() const override { return inner_->name(); }
  bool stateful() const override { return true; }
  std::map<std::string, torch::Tensor> state() const override { return inner_->state(); }
  void load_state(const std::map<std::string, torch::Tensor>& s) override { inner_->load_state(s); }
  void buckets_changed(const std::vector<int64_t>& indices) override {
    inner_->buckets_changed(indices);
  }
  std::vector<int64_t> ran;  // the buckets of the current step

 private:
  std::shared_ptr<CompressionHook> inner_;
};

// What starting `buckets` afresh leaves of the hook's state: as a rebuild,
// their error feedback and PowerSGD's Q dropped; PowerSGD's step counter
// kept, and it counted the failed step's call on each of them.
void start_afresh(RecordingHook& hook, const std::vector<int64_t>& buckets, CompressionKind kind) {
  hook.buckets_changed(buckets);
  if (kind != CompressionKind::PowerSGD) return;
  auto state = hook.state();
  for (int64_t b : buckets) {
    auto& step = state.at("powersgd_step_" + std::to_string(b));
    step = step + 1;
  }
  hook.load_state(state);
}

struct Trained {
  std::vector<torch::Tensor> params;
  std::vector<int64_t> launched;  // the buckets the failed step launched
  size_t buckets = 0;
};

// kSteps steps; `failing`: step kFailStep throws in backward (the user
// catches it and skips the step); otherwise step kFailStep is skipped and
// `launched` started afresh by hand.
Trained train(const std::shared_ptr<Communicator>& comm, CompressionKind kind, bool failing,
              const std::vector<int64_t>& launched) {
  const auto b = make_batches();
  auto fail = std::make_shared<Fail>(Fail::kNot);
  DDPOptions options;
  options.bucket_cap_mb = 1e-6;  // a bucket per parameter
  options.first_bucket_mb = 1e-6;
  DistributedDataParallel<Mlp> ddp(make_model(fail), comm, options);
  auto hook = std::make_shared<RecordingHook>(kind);
  ddp.register_comm_hook(hook);
  auto opt = make_sgd(ddp.parameters());
  const int64_t n = kBatch / comm->size();
  const int r = comm->rank();
  Trained out;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    hook->ran.clear();
    if (s == kFailStep && !failing) {
      start_afresh(*hook, launched, kind);
      continue;
    }
    *fail = s == kFailStep ? Fail::kInBackward : Fail::kNot;
    try {
      backward_of(torch::mse_loss(ddp.forward(rows(b.x, s, r * n, n)), rows(b.y, s, r * n, n)),
                  *fail);
    } catch (const LayerError&) {
      EXPECT_EQ(s, kFailStep) << "rank " << r;
      *fail = Fail::kNot;
      out.launched = hook->ran;
      continue;
    }
    EXPECT_NE(s, kFailStep) << "rank " << r << ": the step did not throw";
    opt.step();
  }
  out.params = clone_all(ddp.parameters());
  out.buckets = ddp.reducer().bucket_layout().size();
  return out;
}

class DDPStepExceptionHook : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(DDPStepExceptionHook, AStatefulHookStartsTheFailedStepsBucketsAfresh) {
  const auto c = GetParam();
  for (auto kind : {CompressionKind::TopK, CompressionKind::Int8, CompressionKind::PowerSGD}) {
    SCOPED_TRACE(compression::to_string(kind));
    std::mutex mu;
    std::map<int, std::pair<Trained, Trained>> got;  // rank -> (failing, reference)
    run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          auto failed = train(comm, kind, /*failing=*/true, {});
          auto reference = train(comm, kind, /*failing=*/false, failed.launched);
          std::lock_guard<std::mutex> lock(mu);
          got[comm->rank()] = {std::move(failed), std::move(reference)};
        },
        options_for(c));
    ASSERT_EQ(got.size(), static_cast<size_t>(c.world));
    for (const auto& [rank, runs] : got) {
      const auto& [failed, reference] = runs;
      // Some buckets launched, not all: the reset must be exactly theirs.
      EXPECT_FALSE(failed.launched.empty()) << "rank " << rank;
      EXPECT_LT(failed.launched.size(), failed.buckets) << "rank " << rank;
      ASSERT_EQ(failed.params.size(), reference.params.size());
      for (size_t i = 0; i < failed.params.size(); ++i) {
        EXPECT_TRUE(torch::equal(failed.params[i], reference.params[i]))
            << "rank " << rank << ", parameter " << i << ": off by "
            << (failed.params[i] - reference.params[i]).abs().max().item<double>();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DDP, DDPStepExceptionHook, ::testing::ValuesIn(engine_worlds()),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::ddp_exception_hook_test
