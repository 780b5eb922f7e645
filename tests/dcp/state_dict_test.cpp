// dcp::get_state_dict -> dcp::save -> fresh model and optimizer ->
// dcp::get_state_dict -> dcp::load -> dcp::set_state_dict, as dcp.h shows
// it, in every mode (one process, DDP, ZeRO-2, FSDP) at worlds 1 and 3:
// every rank's parameters, optimizer state, step counts and group options
// equal the saving job's bit for bit, and the next step equals the saving
// job's next step bit for bit. The state dict is the saving form (built
// before the checkpoint was known) and the optimizer has not stepped, so
// everything the optimizer holds comes from the checkpoint. Across modes
// (DDP world 2 -> FSDP world 3, FSDP world 3 -> DDP world 1) the next step
// equals one process's within 1e-5, with the saved steps and options.
// The fused optimizer's state dict has the keys and layout of LibTorch's
// AdamW on the same module, and round-trips from world 2 to worlds 1 and 3.
#include "cohort/dcp/state_dict/state_dict.h"

#include <mutex>

#include "cohort/dcp/async_save.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/thread_ranks.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::state_dict_test {
namespace {

enum class Mode { Plain, Ddp, Zero, Fsdp, Fused };

std::string name(Mode m) {
  const char* names[] = {"plain", "ddp", "zero2", "fsdp", "fused"};
  return names[static_cast<int>(m)];
}

std::string job_name(Mode m, int world) { return name(m) + std::to_string(world); }

using Ddp = DistributedDataParallel<torch::nn::Sequential>;

// One rank's make_seq(seed) in `mode` and its AdamW (`options`).
struct Job {
  Job(Mode mode, std::shared_ptr<Communicator> comm, uint64_t seed,
      const torch::optim::AdamWOptions& options = kAdamW)
      : seq(make_seq(seed)) {
    if (mode == Mode::Ddp) ddp = std::make_unique<Ddp>(seq, comm);
    if (mode == Mode::Fused) {
      FusedOptions fo;
      fo.bucket_cap_mb = 40.0 * 4 / (1024 * 1024);  // 40 elements: several buckets
      fused = std::make_unique<FusedDistributedOptimizer>(seq->parameters(), comm, options, fo);
      return;
    }
    if (mode == Mode::Fsdp) fsdp = fully_shard(shard_blocks(seq, comm), comm);
    if (mode == Mode::Zero) {
      ZeroOptions zo;
      zo.stage = 2;
      zo.bucket_cap_mb = 16.0 * 4 / (1024 * 1024);  // 16 elements: parameters straddle ranks
      zero =
          ZeroRedundancyOptimizer::make<torch::optim::AdamW>(seq->parameters(), comm, options, zo);
    } else {
      opt = std::make_unique<torch::optim::AdamW>(fsdp ? fsdp->parameters() : seq->parameters(),
                                                  options);
    }
  }

  // Step `s`: the same batch on every rank, so every mode computes what one
  // process does.
  void step(int s) {
    const auto x = batch(100 + s, 12);
    if (fused) {
      fused->zero_grad();
      seq->forward(x).pow(2).mean().backward();
      fused->step();
      return;
    }
    if (zero) {
      zero->zero_grad();
      seq->forward(x).pow(2).mean().backward();
      zero->step();
      return;
    }
    opt->zero_grad();
    auto out = ddp ? ddp->forward(x) : fsdp ? fsdp->forward(x) : seq->forward(x);
    out.pow(2).mean().backward();
    opt->step();
  }

  // What a schedule would have changed by the checkpoint.
  void change_options() {
    if (fused) {
      fused->options().lr(0.004).weight_decay(0.2);
      return;
    }
    for (auto& g : zero ? zero->param_groups() : opt->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(0.004).weight_decay(0.2);
    }
  }

  dcp::StateDict get() {
    if (fused) return dcp::get_state_dict(seq, *fused);
    if (zero) return dcp::get_state_dict(seq, *zero);
    if (fsdp) return dcp::get_state_dict(fsdp, *opt);
    if (ddp) return dcp::get_state_dict(*ddp, *opt);
    return dcp::get_state_dict(seq, *opt);
  }

  void set(const dcp::StateDict& sd) {
    if (fused) return dcp::set_state_dict(seq, *fused, sd);
    if (zero) return dcp::set_state_dict(seq, *zero, sd);
    if (fsdp) return dcp::set_state_dict(fsdp, *opt, sd);
    if (ddp) return dcp::set_state_dict(*ddp, *opt, sd);
    dcp::set_state_dict(seq, *opt, sd);
  }

  // Every box of every tensor this rank holds, by name and box, cloned.
  Named boxes() {
    Named out;
    for (const auto& e : get().tensors) {
      for (const auto& s : e.shards) out[e.fqn + dcp::to_string(s.box)] = s.data.clone();
    }
    return out;
  }

  // The whole parameters (collective under FSDP).
  Named parameters() {
    Named out;
    if (fsdp) {
      for (const auto& p : fsdp->full_state_dict()) out[p.key()] = p.value().clone();
    } else {
      for (const auto& p : seq->named_parameters()) out[p.key()] = p.value().detach().clone();
    }
    return out;
  }

  torch::nn::Sequential seq;
  std::unique_ptr<Ddp> ddp;
  FullyShard fsdp{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<FusedDistributedOptimizer> fused;
};

constexpr int kSteps = 3;

// Trains kSteps, changes the options and saves into `dir`; returns each
// rank's boxes at the save and after one more step.
std::pair<std::map<int, Named>, std::map<int, Named>> train_and_save(Mode mode, int world,
                                                                     const std::string& dir) {
  std::map<int, Named> saved, continued;
  std::mutex mu;
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    Job job(mode, comm, 1);
    for (int s = 0; s < kSteps; ++s) job.step(s);
    job.change_options();
    dcp::save(job.get(), dir, *comm);
    auto at_save = job.boxes();
    job.step(kSteps);
    auto after = job.boxes();
    std::lock_guard<std::mutex> lock(mu);
    saved[comm->rank()] = std::move(at_save);
    continued[comm->rank()] = std::move(after);
  });
  return {saved, continued};
}

// A fresh job (other weights, an optimizer that has not stepped) that loads
// `dir` as dcp.h shows; `check(job, rank)` runs after the load.
template <typename Check>
void load_fresh(Mode mode, int world, const std::string& dir, Check&& check) {
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    Job job(mode, comm, 2);
    auto sd = job.get();
    dcp::load(sd, dir, *comm);
    job.set(sd);
    check(job, comm->rank());
  });
}

class SameMode : public ::testing::TestWithParam<std::tuple<Mode, int>> {};

TEST_P(SameMode, LoadsEverythingAndContinuesBitForBit) {
  const auto [mode, world] = GetParam();
  const auto dir = temp_dir("state_dict_" + job_name(mode, world));
  const auto [saved, continued] = train_and_save(mode, world, dir.string());
  std::mutex mu;
  load_fresh(mode, world, dir.string(), [&](Job& job, int rank) {
    const auto loaded = job.boxes();
    job.step(kSteps);
    const auto next = job.boxes();
    std::lock_guard<std::mutex> lock(mu);
    const auto where =
        name(mode) + " world " + std::to_string(world) + ", rank " + std::to_string(rank);
    // The saving form holds the optimizer's step counts and options too.
    int steps = 0, rates = 0;
    for (const auto& [key, t] : saved.at(rank)) {
      steps += key.find(".step[") != std::string::npos;
      rates += key.rfind("optim.param_groups.", 0) == 0 && key.find(".lr[") != std::string::npos;
    }
    EXPECT_GT(steps, 0) << where;
    EXPECT_GT(rates, 0) << where;
    expect_equal(loaded, saved.at(rank), where + ", loaded");
    expect_equal(next, continued.at(rank), where + ", next step");
  });
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Modes, SameMode,
                         ::testing::Combine(::testing::Values(Mode::Plain, Mode::Ddp, Mode::Zero,
                                                              Mode::Fsdp, Mode::Fused),
                                            ::testing::Values(1, 3)),
                         [](const auto& info) {
                           return job_name(std::get<0>(info.param), std::get<1>(info.param));
                         });

class AcrossModes : public ::testing::TestWithParam<std::tuple<Mode, int, Mode, int>> {};

TEST_P(AcrossModes, ContinuesAsOneProcess) {
  const auto [from, from_world, to, to_world] = GetParam();
  const auto dir = temp_dir("state_dict_" + name(from) + "_" + name(to));
  // One process, continued past the checkpoint.
  Named reference;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    Job job(Mode::Plain, comm, 1);
    for (int s = 0; s < kSteps; ++s) job.step(s);
    job.change_options();
    job.step(kSteps);
    reference = job.parameters();
  });
  train_and_save(from, from_world, dir.string());
  std::mutex mu;
  load_fresh(to, to_world, dir.string(), [&](Job& job, int rank) {
    std::vector<int64_t> steps;
    std::vector<double> lrs;
    if (job.fused) {
      for (size_t i = 0; i < job.fused->params().size(); ++i) {
        steps.push_back(job.fused->param_state(i).step);
      }
      lrs.push_back(job.fused->options().lr());
    } else {
      auto& opt = job.opt ? *job.opt : job.zero->shard_optimizer();
      for (auto& [key, state] : opt.state()) steps.push_back(*state_step(*state));
      for (auto& g : opt.param_groups()) lrs.push_back(g.options().get_lr());
    }
    job.step(kSteps);
    const auto got = job.parameters();
    std::lock_guard<std::mutex> lock(mu);
    const auto where = name(to) + " rank " + std::to_string(rank);
    EXPECT_FALSE(steps.empty()) << where;
    for (auto s : steps) EXPECT_EQ(s, kSteps) << where;
    for (auto lr : lrs) EXPECT_EQ(lr, 0.004) << where;
    ASSERT_EQ(got.size(), reference.size()) << where;
    for (const auto& [n, t] : reference) {
      EXPECT_TRUE(torch::allclose(got.at(n), t, 0, 1e-5)) << where << ": " << n;
    }
  });
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Modes, AcrossModes,
                         ::testing::Values(std::make_tuple(Mode::Ddp, 2, Mode::Fsdp, 3),
                                           std::make_tuple(Mode::Fsdp, 3, Mode::Ddp, 1),
                                           std::make_tuple(Mode::Fused, 2, Mode::Fsdp, 3),
                                           std::make_tuple(Mode::Zero, 3, Mode::Fused, 1)),
                         [](const auto& info) {
                           const auto& p = info.param;
                           return job_name(std::get<0>(p), std::get<1>(p)) + "_to_" +
                                  job_name(std::get<2>(p), std::get<3>(p));
                         });

// The fused optimizer saved at world 2 loads at worlds 1 and 3 into a
// fresh one (other weights, never stepped, default options): every tensor
// of its state dict (parameters, exp_avg, exp_avg_sq, steps, group
// options) equals the saving job's bit for bit, on every rank. The next
// step uses what was loaded, so it was loaded into the flat buffers the
// update reads: at world 1 it equals the saving job's bit for bit (a sum
// of two equal gradients halved is exact), at world 3 within 1e-6.
TEST(FusedStateDict, RoundTripsFromWorld2ToWorlds1And3) {
  const auto dir = temp_dir("state_dict_fused_round_trip");
  const auto [saved, continued] = train_and_save(Mode::Fused, 2, dir.string());
  for (int world : {1, 3}) {
    std::mutex mu;
    load_fresh(Mode::Fused, world, dir.string(), [&](Job& job, int rank) {
      const auto loaded = job.boxes();
      const int64_t timestep = job.fused->timestep();
      job.step(kSteps);
      const auto next = job.boxes();
      std::lock_guard<std::mutex> lock(mu);
      const auto where = "world " + std::to_string(world) + ", rank " + std::to_string(rank);
      int states = 0, options = 0;
      for (const auto& [key, t] : loaded) {
        states += key.find(".exp_avg_sq[") != std::string::npos;
        options += key.rfind("optim.param_groups.", 0) == 0;
      }
      EXPECT_EQ(states, 6) << where;       // every parameter stepped
      EXPECT_EQ(options, 6 * 6) << where;  // lr, betas.0, betas.1, eps, weight_decay, amsgrad
      expect_equal(loaded, saved.at(0), where + ", loaded");
      EXPECT_EQ(job.fused->options().lr(), 0.004) << where;
      EXPECT_EQ(job.fused->options().weight_decay(), 0.2) << where;
      EXPECT_EQ(timestep, kSteps) << where;
      for (const auto& [key, t] : continued.at(0)) {
        const auto& got = next.at(key);
        if (world == 1 || !t.is_floating_point()) {
          EXPECT_TRUE(torch::equal(got, t)) << where << ", next step: " << key;
        } else {
          EXPECT_TRUE(torch::allclose(got, t, 1e-6, 1e-7)) << where << ", next step: " << key;
        }
      }
    });
  }
  std::filesystem::remove_all(dir);
}

// What LibTorch's AdamW state dict holds, entry by entry: name, global
// shape, dtype, replicated, boxes, and the value (the fused update is
// AdamW's to rounding; the step counts exactly).
struct EntryView {
  std::vector<int64_t> shape;
  torch::Dtype dtype;
  bool replicated;
  std::vector<std::string> boxes;
  torch::Tensor value;
};

std::map<std::string, EntryView> entries(const dcp::StateDict& sd) {
  std::map<std::string, EntryView> out;
  for (const auto& e : sd.tensors) {
    EntryView v{e.shape, e.dtype, e.replicated, {}, {}};
    for (const auto& sh : e.shards) v.boxes.push_back(dcp::to_string(sh.box));
    if (!e.shards.empty()) v.value = e.shards.front().data.clone();
    out[e.fqn] = std::move(v);
  }
  return out;
}

// Before any step, after one step with a parameter that got no gradient
// (LibTorch's AdamW then holds no state for it), and after three with
// amsgrad: the fused optimizer's state dict has exactly the entries of
// LibTorch's AdamW over the same module, laid out alike.
TEST(FusedStateDict, KeysAndLayoutAreLibTorchAdamWs) {
  for (bool amsgrad : {false, true}) {
    const auto options = torch::optim::AdamWOptions(kAdamW).amsgrad(amsgrad);
    run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
      Job plain(Mode::Plain, comm, 1, options), fused(Mode::Fused, comm, 1, options);
      auto compare = [&](const std::string& when) {
        const auto want = entries(plain.get()), got = entries(fused.get());
        std::vector<std::string> want_keys, got_keys;
        for (const auto& [k, v] : want) want_keys.push_back(k);
        for (const auto& [k, v] : got) got_keys.push_back(k);
        ASSERT_EQ(got_keys, want_keys) << when;
        for (const auto& [k, w] : want) {
          const auto& g = got.at(k);
          EXPECT_EQ(g.shape, w.shape) << when << ": " << k;
          EXPECT_EQ(g.dtype, w.dtype) << when << ": " << k;
          EXPECT_EQ(g.replicated, w.replicated) << when << ": " << k;
          EXPECT_EQ(g.boxes, w.boxes) << when << ": " << k;
          if (w.dtype == torch::kLong) {
            EXPECT_TRUE(torch::equal(g.value, w.value)) << when << ": " << k;
          } else {
            EXPECT_TRUE(torch::allclose(g.value, w.value, 1e-5, 1e-7)) << when << ": " << k;
          }
        }
      };
      const std::string mode = amsgrad ? "amsgrad, " : "";
      compare(mode + "before any step");
      // A forward without the last Linear's bias: it gets no gradient, and
      // both optimizers skip it (no state, no step).
      for (Job* job : {&plain, &fused}) {
        auto linear = [&](size_t i) { return job->seq->ptr<torch::nn::LinearImpl>(i); };
        auto h = torch::tanh(linear(2)->forward(torch::tanh(linear(0)->forward(batch(7, 12)))));
        torch::matmul(h, linear(4)->weight.t()).pow(2).mean().backward();
        if (job->opt) job->opt->step();
        if (job->fused) job->fused->step();
      }
      compare(mode + "after a step without the last bias");
      for (int s = 0; s < 3; ++s) {
        plain.step(s);
        fused.step(s);
      }
      compare(mode + "after four steps");
    });
  }
}

// LibTorch's AdamW with two groups (no weight decay on the biases) does not
// fit the fused optimizer's one group: loading it is a ConfigError on every
// rank naming the option and a parameter of each group, and the fused
// optimizer's options are left as they were (taking one group's would
// train the other's parameters with options they never had).
TEST(FusedStateDict, GroupsWithOtherOptionsAreAConfigError) {
  const auto dir = temp_dir("state_dict_fused_groups");
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto seq = make_seq(1);
    std::vector<torch::Tensor> weights, biases;
    for (const auto& p : seq->named_parameters()) {
      (p.key().find("bias") != std::string::npos ? biases : weights).push_back(p.value());
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(weights, std::make_unique<torch::optim::AdamWOptions>(kAdamW));
    groups.emplace_back(biases, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(kAdamW).weight_decay(0)));
    torch::optim::AdamW opt(std::move(groups), kAdamW);
    opt.zero_grad();
    seq->forward(batch(100, 12)).pow(2).mean().backward();
    opt.step();
    dcp::save(dcp::get_state_dict(seq, opt), dir.string(), *comm);
  });
  std::mutex mu;
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    Job job(Mode::Fused, comm, 2, torch::optim::AdamWOptions(0.003).weight_decay(0.05));
    auto sd = job.get();
    std::string error;
    try {
      dcp::load(sd, dir.string(), *comm);
    } catch (const ConfigError& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_NE(error.find("weight_decay is 0.1 for 0.weight and 0 for 0.bias"), std::string::npos)
        << error;
    EXPECT_EQ(job.fused->options().weight_decay(), 0.05);
    EXPECT_EQ(job.fused->options().lr(), 0.003);
  });
  std::filesystem::remove_all(dir);
}

// A state dict loaded into, trained on and saved again (the Trainer keeps
// one): the save writes the step counts and group options the optimizer
// holds at the save, not those of the load. kSteps saved, loaded, two more
// steps and a new rate: the second checkpoint holds kSteps + 2 and the new
// rate for every parameter, in every mode at worlds 1 and 3.
class LiveCounts : public ::testing::TestWithParam<std::tuple<Mode, int>> {};

TEST_P(LiveCounts, ASaveAfterMoreStepsWritesTheCurrentStepAndOptions) {
  const auto [mode, world] = GetParam();
  const auto dir = temp_dir("live_" + job_name(mode, world));
  const auto again = temp_dir("live_again_" + job_name(mode, world));
  train_and_save(mode, world, dir.string());
  run_ranks_shared(world, [&, mode = mode](std::shared_ptr<Communicator> comm) {
    Job job(mode, comm, 2);
    auto sd = job.get();
    dcp::load(sd, dir.string(), *comm);
    job.step(kSteps);
    job.step(kSteps + 1);
    if (job.fused) {
      job.fused->options().lr(0.007);
    } else {
      for (auto& g : job.zero ? job.zero->param_groups() : job.opt->param_groups()) {
        g.options().set_lr(0.007);
      }
    }
    dcp::save(sd, again.string(), *comm);
  });
  const auto meta = dcp::read_metadata(again.string());
  int steps = 0, rates = 0;
  for (const auto& t : meta.tensors) {
    const auto at = [&](const std::string& end) {
      return t.fqn.size() > end.size() &&
             t.fqn.compare(t.fqn.size() - end.size(), end.size(), end) == 0;
    };
    if (t.fqn.rfind("optim.", 0) == 0 && at(".step")) {
      ++steps;
      EXPECT_EQ(dcp::read_tensor(again.string(), meta, t.fqn).item<int64_t>(), kSteps + 2) << t.fqn;
    }
    if (t.fqn.rfind("optim.param_groups.", 0) == 0 && at(".lr")) {
      ++rates;
      EXPECT_EQ(dcp::read_tensor(again.string(), meta, t.fqn).item<double>(), 0.007) << t.fqn;
    }
  }
  EXPECT_EQ(steps, 6);  // make_seq's three Linear layers
  EXPECT_EQ(rates, 6);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(again);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, LiveCounts,
    ::testing::Combine(::testing::Values(Mode::Plain, Mode::Zero, Mode::Fsdp, Mode::Fused),
                       ::testing::Values(1, 3)),
    [](const auto& info) { return job_name(std::get<0>(info.param), std::get<1>(info.param)); });

// A state dict made at setup, before the optimizer's first step (LibTorch's
// optimizers make their state then, the fused optimizer saves a
// parameter's once it stepped), kept and saved after kSteps with save() or
// async_save(): the checkpoint holds every parameter's exp_avg and
// exp_avg_sq and step kSteps, and a fresh job loads everything equal to
// the saving job's bit for bit, in every mode at worlds 1 and 3. The kept
// state dict is also a source set_state_dict takes (it sets the values the
// job holds).
class KeptFromSetup : public ::testing::TestWithParam<std::tuple<Mode, int, bool>> {};

TEST_P(KeptFromSetup, SavesTheStateTheOptimizerMadeSince) {
  const auto [mode, world, async] = GetParam();
  const auto dir = temp_dir("kept_" + job_name(mode, world) + (async ? "_async" : ""));
  std::map<int, Named> saved;
  std::mutex mu;
  run_ranks_shared(world, [&, mode = mode, async = async](std::shared_ptr<Communicator> comm) {
    Job job(mode, comm, 1);
    auto sd = job.get();  // no optimizer state yet
    for (int s = 0; s < kSteps; ++s) job.step(s);
    if (async) {
      dcp::async_save(sd, dir.string(), *comm).wait();
    } else {
      dcp::save(sd, dir.string(), *comm);
    }
    auto at_save = job.boxes();  // a state dict made now: all the optimizer holds
    std::string set_error;
    try {
      job.set(sd);
    } catch (const Error& e) {
      set_error = e.what();
    }
    auto after_set = job.boxes();
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(set_error, "");
    expect_equal(after_set, at_save, "rank " + std::to_string(comm->rank()) + ", set from it");
    saved[comm->rank()] = std::move(at_save);
  });
  const auto meta = dcp::read_metadata(dir.string());
  int moments = 0, steps = 0;
  for (const auto& t : meta.tensors) {
    const auto ends = [&](const std::string& end) {
      return t.fqn.size() > end.size() &&
             t.fqn.compare(t.fqn.size() - end.size(), end.size(), end) == 0;
    };
    moments += ends(".exp_avg") + ends(".exp_avg_sq");
    if (t.fqn.rfind("optim.", 0) == 0 && ends(".step")) {
      ++steps;
      EXPECT_EQ(dcp::read_tensor(dir.string(), meta, t.fqn).item<int64_t>(), kSteps) << t.fqn;
    }
  }
  EXPECT_EQ(moments, 2 * 6);  // make_seq's three Linear layers
  EXPECT_EQ(steps, 6);
  std::mutex check_mu;
  load_fresh(mode, world, dir.string(), [&](Job& job, int rank) {
    const auto loaded = job.boxes();
    std::lock_guard<std::mutex> lock(check_mu);
    expect_equal(loaded, saved.at(rank), "rank " + std::to_string(rank) + ", loaded");
  });
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Modes, KeptFromSetup,
                         ::testing::Combine(::testing::Values(Mode::Plain, Mode::Ddp, Mode::Zero,
                                                              Mode::Fsdp, Mode::Fused),
                                            ::testing::Values(1, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return job_name(std::get<0>(info.param), std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_async" : "");
                         });

// A state dict whose entries the caller changed (an entry left out) and
// that is out of date (the optimizer stepped since): it cannot be made
// again with the change, so save() refuses it on every rank with an
// InvalidArgument saying to call get_state_dict again, and writes no
// checkpoint.
TEST(KeptFromSetup, AChangedStateDictOutOfDateIsRefusedOnEveryRank) {
  const auto dir = temp_dir("kept_changed");
  std::mutex mu;
  std::vector<std::string> errors;
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    Job job(Mode::Ddp, comm, 1);
    auto sd = job.get();
    sd.tensors.pop_back();  // an option of the last parameter
    job.step(0);
    try {
      dcp::save(sd, dir.string(), *comm);
    } catch (const InvalidArgument& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(e.what());
    }
  });
  ASSERT_EQ(errors.size(), 3u);
  for (const auto& e : errors) {
    EXPECT_NE(e.find("rank 0: dcp::save on rank 0: the state dict is out of date (optim."),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("its entries were changed after get_state_dict made it"), std::string::npos)
        << e;
    EXPECT_NE(e.find("call get_state_dict again"), std::string::npos) << e;
  }
  EXPECT_FALSE(std::filesystem::exists(dir / ".metadata"));
  std::filesystem::remove_all(dir);
}

// A parameter registered transposed (its storage column-major): Adam's
// exp_avg is zeros_like(param, Preserve), strided alike. A state dict made
// before the last step and saved after it writes the state after it, and a
// load into an Adam that has stepped (its state strided) fills that state,
// at worlds 1 and 3: the loaded state equals the saving job's exactly.
struct TransposedImpl : torch::nn::Module {
  torch::Tensor w;
  explicit TransposedImpl(uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    w = register_parameter("w", torch::randn({4, 3}, gen).t());
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, w); }
};
TORCH_MODULE(Transposed);

void train_transposed(Transposed& m, torch::optim::Adam& opt, int from, int steps) {
  for (int s = from; s < from + steps; ++s) {
    opt.zero_grad();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(200 + s);
    m->forward(torch::randn({5, 3}, gen)).pow(2).mean().backward();
    opt.step();
  }
}

Named adam_state(Transposed& m, torch::optim::Adam& opt) {
  Named out;
  for (const auto& [name, t] : state_tensors(*opt.state().at(cohort::optimizer_state_key(m->w)))) {
    out[name] = t.clone();
  }
  out["w"] = m->w.detach().clone();
  return out;
}

class StridedState : public ::testing::TestWithParam<int> {};

TEST_P(StridedState, SavesAndLoadsTheOptimizersOwnTensors) {
  const int world = GetParam();
  const auto dir = temp_dir("strided_" + std::to_string(world));
  Named saved;
  std::mutex mu;
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    Transposed m(1);
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(0.01));
    train_transposed(m, opt, 0, 2);
    auto sd = dcp::get_state_dict(*m, opt);
    train_transposed(m, opt, 2, 1);  // after the state dict is made
    dcp::save(sd, dir.string(), *comm);
    std::lock_guard<std::mutex> lock(mu);
    if (comm->rank() == 0) saved = adam_state(m, opt);
  });
  ASSERT_FALSE(saved.at("exp_avg").is_contiguous());
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    Transposed m(2);
    torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(0.01));
    train_transposed(m, opt, 10, 1);  // its own state, strided
    auto sd = dcp::get_state_dict(*m, opt);
    dcp::load(sd, dir.string(), *comm);
    const auto got = adam_state(m, opt);
    std::lock_guard<std::mutex> lock(mu);
    expect_equal(got, saved, "rank " + std::to_string(comm->rank()));
    EXPECT_EQ(*state_step(*opt.state().at(cohort::optimizer_state_key(m->w))), 3);
  });
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Worlds, StridedState, ::testing::Values(1, 3));

// ZeRO's flat order is group by group, not the model's: two LayerNorms with
// the weights in one group (lr 0.01) and the biases in another (lr 0.02)
// are stepped as 0.weight, 1.weight, 0.bias, 1.bias. Every parameter's
// state, step and rate is saved under its own name, as one process with
// LibTorch's AdamW over the same groups holds them (to 1e-6), at worlds 1
// and 3.
std::vector<torch::optim::OptimizerParamGroup> weights_and_biases(torch::nn::Sequential& seq) {
  std::vector<torch::Tensor> weights, biases;
  for (const auto& p : seq->named_parameters()) {
    (p.key().find("weight") != std::string::npos ? weights : biases).push_back(p.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights, std::make_unique<torch::optim::AdamWOptions>(0.01));
  groups.emplace_back(biases, std::make_unique<torch::optim::AdamWOptions>(0.02));
  return groups;
}

torch::nn::Sequential layer_norms() {
  return torch::nn::Sequential(torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})),
                               torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
}

torch::Tensor ln_loss(torch::nn::Sequential& seq, int s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + s);
  const auto x = torch::randn({4, 6}, gen);
  return (seq->forward(x) * torch::arange(6, torch::kFloat)).pow(3).mean();
}

class ZeroPairing : public ::testing::TestWithParam<int> {};

TEST_P(ZeroPairing, GroupsInAnotherOrderKeepEachParametersState) {
  const int world = GetParam();
  const auto dir = temp_dir("zero_pairing_" + std::to_string(world));
  Named reference;
  {
    auto seq = layer_norms();
    torch::optim::AdamW opt(weights_and_biases(seq), torch::optim::AdamWOptions(0.5));
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      ln_loss(seq, s).backward();
      opt.step();
    }
    reference = snapshot(*seq, &opt);
  }
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    auto seq = layer_norms();
    ZeroRedundancyOptimizer zero(
        weights_and_biases(seq),
        [](std::vector<torch::optim::OptimizerParamGroup> shard) {
          return std::make_unique<torch::optim::AdamW>(std::move(shard),
                                                       torch::optim::AdamWOptions(0.5));
        },
        comm);
    for (int s = 0; s < 2; ++s) {
      zero.zero_grad();
      ln_loss(seq, s).backward();
      zero.step();
    }
    dcp::save(dcp::get_state_dict(seq, zero), dir.string(), *comm);
  });
  const auto meta = dcp::read_metadata(dir.string());
  for (const auto& [name, want] : reference) {
    const auto got = dcp::read_tensor(dir.string(), meta, name);
    if (want.is_floating_point()) {
      EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6)) << name << ": " << got << " vs " << want;
    } else {
      EXPECT_TRUE(torch::equal(got, want)) << name;
    }
  }
  for (const char* p : {"0.weight", "1.weight", "0.bias", "1.bias"}) {
    const double lr = std::string(p).find("weight") != std::string::npos ? 0.01 : 0.02;
    EXPECT_EQ(dcp::read_tensor(dir.string(), meta, std::string("optim.param_groups.") + p + ".lr")
                  .item<double>(),
              lr)
        << p;
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ZeroPairing, ::testing::Values(1, 3));

}  // namespace
}  // namespace cohort::testing::dcp_test::state_dict_test
