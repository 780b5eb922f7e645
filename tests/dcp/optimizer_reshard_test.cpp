// An optimizer of three parameter groups (other lr, weight decay, betas,
// amsgrad or momentum and nesterov in each; one group whose parameters are
// all frozen; three weights of one shape in three groups) goes through a
// chain of checkpoints: each job trains, lowers every group's lr (a
// schedule) and saves; the next job, in another mode at another world size,
// builds its groups in another order with the parameters reversed and
// other options, loads and trains on. The last job's checkpoint holds, by
// name, what one process training the whole way without a checkpoint
// holds: every parameter, exp_avg, exp_avg_sq, max_exp_avg_sq, step and
// momentum_buffer on its own parameter, every option on its own group's
// parameters. AdamW and SGD, over gloo and UCX.
#include <mutex>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/engine_worlds.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::optimizer_reshard_test {
namespace {

namespace fs = std::filesystem;
using torch::optim::AdamWOptions;
using torch::optim::SGDOptions;

enum class Mode { Plain, Ddp, Zero1, Zero2, Fsdp };
enum class Kind { AdamW, Sgd };

std::string name(Mode m) {
  const char* names[] = {"plain", "ddp", "zero1", "zero2", "fsdp"};
  return names[static_cast<int>(m)];
}

// Three [5, 5] weights and a [1, 5] one; layer 2 frozen.
torch::nn::Sequential make_model(uint64_t seed) {
  using torch::nn::Linear;
  using torch::nn::Tanh;
  torch::nn::Sequential seq(Linear(5, 5), Tanh(), Linear(5, 5), Tanh(), Linear(5, 5), Tanh(),
                            Linear(5, 1));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : seq->named_parameters()) {
    p.value().copy_(torch::randn(p.value().sizes(), gen));
    if (p.key().rfind("2.", 0) == 0) p.value().requires_grad_(false);
  }
  return seq;
}

// A group: its parameters' names and which of the saved options it has.
struct GroupSpec {
  std::vector<std::string> names;
  int options;
};
// The first job's order, and the other order the next jobs alternate with.
const std::vector<GroupSpec> kFirstOrder = {{{"4.bias", "0.weight", "6.weight"}, 0},
                                            {{"2.weight", "2.bias"}, 1},
                                            {{"6.bias", "4.weight", "0.bias"}, 2}};
const std::vector<GroupSpec> kOtherOrder = {{{"0.bias", "6.bias", "4.weight"}, 2},
                                            {{"2.bias", "2.weight"}, 1},
                                            {{"6.weight", "0.weight", "4.bias"}, 0}};

// Group `i`'s options at the start of training; group 1 is the frozen one.
std::unique_ptr<torch::optim::OptimizerOptions> first_options(Kind kind, int i) {
  if (kind == Kind::AdamW) {
    const AdamWOptions all[] = {
        AdamWOptions(0.01).weight_decay(0.1), AdamWOptions(0.5).weight_decay(0.3),
        AdamWOptions(0.03).betas({0.8, 0.95}).eps(1e-6).weight_decay(0).amsgrad(true)};
    return std::make_unique<AdamWOptions>(all[i]);
  }
  const SGDOptions all[] = {SGDOptions(0.05).momentum(0.9).weight_decay(0.01),
                            SGDOptions(0.5).momentum(0.9),
                            SGDOptions(0.1).momentum(0.5).nesterov(true).weight_decay(0.02)};
  return std::make_unique<SGDOptions>(all[i]);
}

// A loading job's options: none of the saved ones.
std::unique_ptr<torch::optim::OptimizerOptions> other_options(Kind kind) {
  if (kind == Kind::AdamW) return std::make_unique<AdamWOptions>(AdamWOptions(0.007));
  return std::make_unique<SGDOptions>(SGDOptions(0.007).momentum(0.2).dampening(0.1));
}

using Ddp = DistributedDataParallel<torch::nn::Sequential>;

// One rank's model in `mode` and its optimizer of `order`'s groups.
struct Job {
  Job(Mode mode, Kind kind, std::shared_ptr<Communicator> comm, uint64_t seed,
      const std::vector<GroupSpec>& order, bool first)
      : seq(make_model(seed)) {
    if (mode == Mode::Ddp) ddp = std::make_unique<Ddp>(seq, comm);
    if (mode == Mode::Fsdp) fsdp = fully_shard(shard_blocks(seq, comm), comm);
    std::map<std::string, torch::Tensor> by_name;
    for (const auto& p : fsdp ? fsdp->named_parameters() : seq->named_parameters()) {
      by_name[p.key()] = p.value();
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const auto& g : order) {
      std::vector<torch::Tensor> params;
      for (const auto& n : g.names) params.push_back(by_name.at(n));
      groups.emplace_back(params, first ? first_options(kind, g.options) : other_options(kind));
    }
    if (mode == Mode::Zero1 || mode == Mode::Zero2) {
      ZeroOptions zo;
      zo.stage = mode == Mode::Zero1 ? 1 : 2;
      zo.bucket_cap_mb = 16.0 * 4 / (1024 * 1024);  // 16 elements: parameters straddle ranks
      zero = kind == Kind::AdamW ? ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
                                       std::move(groups), comm, AdamWOptions(0.001), zo)
                                 : ZeroRedundancyOptimizer::make<torch::optim::SGD>(
                                       std::move(groups), comm, SGDOptions(0.001), zo);
    } else if (kind == Kind::AdamW) {
      opt = std::make_unique<torch::optim::AdamW>(std::move(groups), AdamWOptions(0.001));
    } else {
      opt = std::make_unique<torch::optim::SGD>(std::move(groups), SGDOptions(0.001));
    }
  }

  // Step `s`: the same batch on every rank, so every mode computes what one
  // process does.
  void step(int s) {
    const auto x = batch(100 + s, 12);
    if (zero) {
      zero->zero_grad();
    } else {
      opt->zero_grad();
    }
    auto out = ddp ? ddp->forward(x) : fsdp ? fsdp->forward(x) : seq->forward(x);
    out.pow(2).mean().backward();
    if (zero) {
      zero->step();
    } else {
      opt->step();
    }
  }

  // A schedule: every group's lr halved (the same whatever the groups' order).
  void lower_rates() {
    for (auto& g : zero ? zero->param_groups() : opt->param_groups()) {
      g.options().set_lr(g.options().get_lr() / 2);
    }
  }

  dcp::StateDict get() {
    if (zero) return dcp::get_state_dict(seq, *zero);
    if (fsdp) return dcp::get_state_dict(fsdp, *opt);
    if (ddp) return dcp::get_state_dict(*ddp, *opt);
    return dcp::get_state_dict(seq, *opt);
  }

  void set(const dcp::StateDict& sd) {
    if (zero) return dcp::set_state_dict(seq, *zero, sd);
    if (fsdp) return dcp::set_state_dict(fsdp, *opt, sd);
    if (ddp) return dcp::set_state_dict(*ddp, *opt, sd);
    dcp::set_state_dict(seq, *opt, sd);
  }

  torch::nn::Sequential seq;
  std::unique_ptr<Ddp> ddp;
  FullyShard fsdp{nullptr};
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
};

constexpr int kSteps = 2;  // per job

// One job of a chain: `mode` at `world` ranks.
struct Link {
  Mode mode;
  int world;
};

// Job i of `chain` loads checkpoint i - 1 (the first starts from seed 1),
// trains kSteps, lowers the rates and saves checkpoint i under `dir`.
// Returns the last checkpoint's folder.
fs::path run_chain(const std::vector<Link>& chain, Kind kind, const EngineWorld& engine,
                   const fs::path& dir) {
  fs::path last;
  for (size_t i = 0; i < chain.size(); ++i) {
    const auto out = dir / ("ckpt" + std::to_string(i));
    const auto& order = i % 2 == 0 ? kFirstOrder : kOtherOrder;
    run_ranks_shared(
        chain[i].world,
        [&](std::shared_ptr<Communicator> comm) {
          Job job(chain[i].mode, kind, comm, i == 0 ? 1 : 2, order, i == 0);
          if (i > 0) {
            auto sd = job.get();
            dcp::load(sd, last.string(), *comm);
            job.set(sd);
          }
          for (int s = 0; s < kSteps; ++s) job.step(static_cast<int>(i) * kSteps + s);
          job.lower_rates();
          dcp::save(job.get(), out.string(), *comm);
        },
        options_for(engine));
    last = out;
  }
  return last;
}

// Every tensor of checkpoint `dir`, whole, by name.
Named read_all(const fs::path& dir) {
  const auto meta = dcp::read_metadata(dir.string());
  Named out;
  for (const auto& t : meta.tensors) out[t.fqn] = dcp::read_tensor(dir.string(), meta, t.fqn);
  return out;
}

struct Case {
  Kind kind;
  std::vector<Link> chain;
  EngineWorld engine;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string out = info.param.kind == Kind::AdamW ? "adamw" : "sgd";
  for (const auto& l : info.param.chain) out += "_" + name(l.mode) + std::to_string(l.world);
  return out + "_" + info.param.engine.backend;
}

class ParamGroupChain : public ::testing::TestWithParam<Case> {};

TEST_P(ParamGroupChain, EndsWhereOneProcessWithoutCheckpointsDoes) {
  const auto& c = GetParam();
  const auto dir = temp_dir("optimizer_reshard_" + case_name({c, 0}));
  // One process without checkpoints, in the first job's group order: all
  // the steps, lowering the rates where each job of the chain does.
  const auto ref_dir = dir / "reference";
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    Job job(Mode::Plain, c.kind, comm, 1, kFirstOrder, true);
    for (size_t i = 0; i < c.chain.size(); ++i) {
      for (int s = 0; s < kSteps; ++s) job.step(static_cast<int>(i) * kSteps + s);
      job.lower_rates();
    }
    dcp::save(job.get(), ref_dir.string(), *comm);
  });
  const auto expected = read_all(ref_dir);
  const auto got = read_all(run_chain(c.chain, c.kind, c.engine, dir));
  std::vector<std::string> expected_names, got_names;
  for (const auto& [n, t] : expected) expected_names.push_back(n);
  for (const auto& [n, t] : got) got_names.push_back(n);
  ASSERT_EQ(got_names, expected_names);
  int states = 0, options = 0;
  for (const auto& [n, want] : expected) {
    const auto& have = got.at(n);
    if (want.is_floating_point() && want.scalar_type() != torch::kDouble) {
      EXPECT_TRUE(torch::allclose(have, want, 1e-4, 1e-6))
          << n << ": got " << have << "\nwant " << want;
    } else {
      EXPECT_TRUE(torch::equal(have, want)) << n << ": got " << have << ", want " << want;
    }
    states += n.rfind("optim.", 0) == 0 && n.rfind("optim.param_groups.", 0) != 0;
    options += n.rfind("optim.param_groups.", 0) == 0;
  }
  // The frozen layer has options but no state; the others both.
  EXPECT_EQ(
      expected.count("optim.2.weight.step") + expected.count("optim.2.weight.momentum_buffer"), 0u);
  EXPECT_EQ(expected.count("optim.param_groups.2.weight.lr"), 1u);
  EXPECT_GT(states, 0);
  EXPECT_GT(options, 0);
  fs::remove_all(dir);
}

std::vector<Case> cases() {
  const std::vector<std::vector<Link>> chains = {
      {{Mode::Fsdp, 2}, {Mode::Zero2, 3}, {Mode::Plain, 1}},
      {{Mode::Plain, 1}, {Mode::Ddp, 3}, {Mode::Fsdp, 3}, {Mode::Zero1, 2}}};
  std::vector<Case> out;
  for (const auto& engine : engine_worlds({0})) {
    for (const Kind kind : {Kind::AdamW, Kind::Sgd}) {
      for (const auto& chain : chains) out.push_back({kind, chain, engine});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Chains, ParamGroupChain, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::dcp_test::optimizer_reshard_test
