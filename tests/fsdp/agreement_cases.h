// defines: agreement_cases, ranks that build or run a fully sharded model
// differently (an extra unit, another reshard_after_forward, a unit whose
// forward one rank skips, a weight tied across units), written once and run
// by ranks as threads (agreement_test.cpp: Gloo, UCX) and as processes
// (world_test.cpp: under mpirun, and cohortrun). Each case must end in an
// exception on every rank, naming what differs and the odd rank (the last).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cohort/fsdp/fully_shard.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::fsdp_test {

struct AgreementCase {
  std::string name;
  int min_world;
  // Builds and trains on `comm`: throws on every rank.
  std::function<void(std::shared_ptr<Communicator>)> run;
  // What every rank's message contains, at world `n` (the odd rank is n - 1).
  std::function<std::vector<std::string>(int n)> expect;
};

// One training step of `model` on rank-dependent rows.
inline void one_step(FullyShard& model, const Communicator& comm, int64_t width = 4) {
  auto x = torch::full({2, width}, 0.1 * (1 + comm.rank()));
  model->forward(x).square().mean().backward();
}

inline std::string odd_rank(int n) { return "rank " + std::to_string(n - 1) + ":"; }

// Three units of the same shape and a head held by the root; `skip` leaves
// the middle unit out of the forward.
struct SkippyImpl : torch::nn::Module {
  std::vector<FullyShard> units;
  torch::nn::Linear head{nullptr};
  bool skip = false;
  explicit SkippyImpl(const std::shared_ptr<Communicator>& comm) {
    for (int i = 0; i < 3; ++i)
      units.push_back(
          register_module("u" + std::to_string(i), FullyShard(AnyModule(Linear(4, 4)), comm)));
    head = register_module("head", Linear(4, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < units.size(); ++i) {
      if (skip && i == 1) continue;
      x = torch::tanh(units[i]->forward(x));
    }
    return head(x);
  }
};
TORCH_MODULE(Skippy);

inline std::vector<AgreementCase> make_agreement_cases() {
  std::vector<AgreementCase> cases;
  cases.push_back({"ExtraUnitOnOneRank", 2,
                   [](std::shared_ptr<Communicator> comm) {
                     Sequential seq(Linear(4, 4), Tanh(), Linear(4, 4));
                     if (comm->rank() == comm->size() - 1) seq->push_back(Linear(4, 4));
                     auto model = fully_shard(shard_blocks(seq, comm), comm);
                     one_step(model, *comm);
                   },
                   [](int n) {
                     return std::vector<std::string>{"fully_shard", "the units in its tree differ",
                                                     odd_rank(n)};
                   }});
  cases.push_back({"ReshardAfterForwardDiffers", 2,
                   [](std::shared_ptr<Communicator> comm) {
                     FullyShardOptions o;
                     o.reshard_after_forward = comm->rank() != comm->size() - 1;
                     auto model = fully_shard(
                         shard_blocks(Sequential(Linear(4, 4), Tanh(), Linear(4, 4)), comm, o),
                         comm);
                     one_step(model, *comm);
                   },
                   [](int n) {
                     return std::vector<std::string>{"reshard_after_forward differs", odd_rank(n)};
                   }});
  cases.push_back(
      {"ReshardAfterForwardSetOnOneRank", 2,
       [](std::shared_ptr<Communicator> comm) {
         auto seq = shard_blocks(Sequential(Linear(4, 4), Tanh(), Linear(4, 4)), comm);
         auto model = fully_shard(seq, comm);
         one_step(model, *comm);
         if (comm->rank() == comm->size() - 1)
           seq[2]->as<FullyShardImpl>()->set_reshard_after_forward(false);
         one_step(model, *comm);
       },
       [](int n) {
         return std::vector<std::string>{"reshard_after_forward of unit '2'", odd_rank(n)};
       }});
  cases.push_back({"UnitForwardSkippedOnOneRank", 2,
                   [](std::shared_ptr<Communicator> comm) {
                     auto bare = Skippy(comm);
                     auto model = fully_shard(AnyModule(bare), comm);
                     one_step(model, *comm);  // every rank runs every unit
                     bare->skip = comm->rank() == comm->size() - 1;
                     one_step(model, *comm);
                   },
                   [](int n) {
                     return std::vector<std::string>{"different points of the fully sharded",
                                                     "unit 'u1'", odd_rank(n)};
                   }});
  // A weight tied across two layers: rows that do not divide by 2 or 3 (5),
  // and rows that do (6).
  for (int64_t rows : {5, 6}) {
    cases.push_back(
        {"WeightTiedAcrossBlocks" + std::to_string(rows) + "Rows", 1,
         [rows](std::shared_ptr<Communicator> comm) {
           auto w = torch::randn({rows, 7});
           Sequential seq{InProj(w), Tanh(), OutProj(w)};
           try {
             shard_blocks(seq, comm);
           } catch (...) {
             EXPECT_EQ(w.sizes(), (std::vector<int64_t>{rows, 7})) << "sharded before the error";
             throw;
           }
         },
         [](int) {
           return std::vector<std::string>{"shard_blocks", "'2.w'", "'0.w'", "layers 0 and 2"};
         }});
  }
  cases.push_back({"WeightTiedAcrossSiblingUnits", 1,
                   [](std::shared_ptr<Communicator> comm) {
                     auto w = torch::randn({6, 7});
                     auto first = FullyShard(AnyModule(InProj(w)), comm);
                     auto second = FullyShard(AnyModule(OutProj(w)), comm);
                   },
                   [](int) {
                     return std::vector<std::string>{"OutProjImpl)", "parameter 'w'",
                                                     "also held by another unit",
                                                     "InProjImpl, as its 'w'"};
                   }});
  return cases;
}

// Built once: tests hold references into it.
inline const std::vector<AgreementCase>& agreement_cases() {
  static const auto cases = make_agreement_cases();
  return cases;
}

}  // namespace cohort::testing::fsdp_test
