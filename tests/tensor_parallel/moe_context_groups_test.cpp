// average_moe_gradients under context parallelism: MoE(mesh, options) counts
// its load-balancing loss over the mesh's "cp", whose ranks hold different
// tokens of the same sequences, so the router must be averaged over
// dp x ep x cp and the experts summed over dp x cp. With those groups every
// rank's gradients equal one process's (float64, 1e-12); the groups of a
// mesh without cp (mesh[{"dp", "ep"}] and mesh["dp"]) are refused on every
// rank, and accepted, how far the router falls from one process's is the
// figure in the failure. Meshes dp x ep x cp of 1 x 2 x 2, 1 x 1 x 3 and
// 2 x 1 x 2 (the last with replicas of the right size but one cp rank).
// An input of another width on world rank 1 alone is refused on every rank
// of its sequence and ep groups, naming it, the refusal relayed from the
// sequence group to the ep group.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <ostream>
#include <stdexcept>

#include "cohort/expert_parallel/moe.h"
#include "support/rank_errors.h"
#include "support/thread_ranks.h"

namespace cohort::testing::moe_context_groups_test {
namespace {

using namespace cohort::expert_parallel;

struct Case {
  std::string backend;
  int dp, ep, cp;
  int world() const { return dp * ep * cp; }
};

std::vector<Case> cases() {
  std::vector<std::string> backends = {"gloo"};
#ifdef COHORT_WITH_UCX
  backends.push_back("ucx");
#endif
  std::vector<Case> out;
  for (const auto& b : backends) {
    for (auto [dp, ep, cp] : {std::tuple{1, 2, 2}, std::tuple{1, 1, 3}, std::tuple{2, 1, 2}}) {
      out.push_back({b, dp, ep, cp});
    }
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  return c.backend + "_dp" + std::to_string(c.dp) + "_ep" + std::to_string(c.ep) + "_cp" +
         std::to_string(c.cp);
}

// How gtest prints a failing case's parameter.
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.backend << " dp " << c.dp << " x ep " << c.ep << " x cp " << c.cp;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

MoEOptions options() {
  MoEOptions o;
  o.hidden = 4;
  o.ffn = 6;
  o.experts = 4;
  o.top_k = 1;
  o.seed = 1;
  // No token dropped: one process routes each sequence as the ranks do.
  o.capacity_factor = 100;
  o.aux_loss_coef = 0.5;
  return o;
}

// Rank (d, e, c)'s tokens (rank-dependent counts) and its loss probe.
int64_t index_of(const Case& k, int d, int e, int c) { return (d * k.ep + e) * k.cp + c; }
torch::Tensor draw(int64_t rows, uint64_t seed) {
  return torch::randn({rows, 4}, at::detail::createCPUGenerator(seed)).to(torch::kFloat64);
}
torch::Tensor tokens(int64_t i) { return draw(3 + i % 3, 10 + i); }
torch::Tensor probe(int64_t i) { return draw(3 + i % 3, 50 + i); }

// One process: each (dp, ep) rank's sequence is its cp ranks' tokens in
// turn, its load-balancing loss the whole sequence's. The loss is the mean
// over the dense ranks of sum(y * probe) plus the mean over sequences of the
// auxiliary loss (each cp rank's share of it is scaled by cp).
MoE reference(const Case& k) {
  MoE m(options());
  m->to(torch::kFloat64);
  torch::Tensor loss = torch::zeros({}, torch::kFloat64);
  for (int d = 0; d < k.dp; ++d) {
    for (int e = 0; e < k.ep; ++e) {
      std::vector<torch::Tensor> xs, ps;
      for (int c = 0; c < k.cp; ++c) {
        xs.push_back(tokens(index_of(k, d, e, c)));
        ps.push_back(probe(index_of(k, d, e, c)));
      }
      auto y = m(torch::cat(xs));
      loss = loss + (y * torch::cat(ps)).sum() / k.world() + m->aux_loss() / (k.dp * k.ep);
    }
  }
  loss.backward();
  return m;
}

class MoeContextGroups : public ::testing::TestWithParam<Case> {
 protected:
  // Every rank's error, "accepted" where the gradients were averaged (and
  // compared with one process's).
  std::vector<std::string> run(bool right) {
    const Case k = GetParam();
    const MoE ref = reference(k);
    ThreadRanksOptions o;
    o.backend = k.backend;
    o.timeout = std::chrono::seconds(5);
    return errors_on_every_rank(
        k.world(),
        [&](std::shared_ptr<Communicator> world) {
          torch::set_num_threads(1);
          auto mesh = init_device_mesh(world, {k.dp, k.ep, k.cp}, {"dp", "ep", "cp"});
          MoE m(mesh, options());
          m->to(torch::kFloat64);
          const int64_t i =
              index_of(k, mesh.local_rank("dp"), mesh.local_rank("ep"), mesh.local_rank("cp"));
          auto y = m(tokens(i));
          ((y * probe(i)).sum() + m->aux_loss()).backward();
          if (right) {
            average_moe_gradients(*m, *mesh[{"dp", "ep", "cp"}].process_group(),
                                  *mesh[{"dp", "cp"}].process_group());
          } else {
            average_moe_gradients(*m, *mesh[{"dp", "ep"}].process_group(),
                                  *mesh["dp"].process_group());
          }
          const double router = (m->router.grad() - ref->router.grad()).abs().max().item<double>();
          double experts = 0;
          for (const auto& [mine, all] : {std::pair{m->w1, ref->w1}, std::pair{m->b1, ref->b1},
                                          std::pair{m->w2, ref->w2}, std::pair{m->b2, ref->b2}}) {
            const auto want = all.grad().narrow(0, m->first_expert(), m->local_experts());
            experts = std::max(experts, (mine.grad() - want).abs().max().item<double>());
          }
          throw std::runtime_error("accepted; off one process's by " + std::to_string(router) +
                                   " (router), " + std::to_string(experts) + " (experts)" +
                                   (router < 1e-12 && experts < 1e-12 ? "" : " MISMATCH"));
        },
        o);
  }
};

TEST_P(MoeContextGroups, DenseAndReplicasOverCpEqualOneProcess) {
  const auto errors = run(true);
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_TRUE(has(errors[r], "accepted")) << "rank " << r << ": " << errors[r];
    EXPECT_FALSE(has(errors[r], "MISMATCH")) << "rank " << r << ": " << errors[r];
  }
}

TEST_P(MoeContextGroups, GroupsWithoutCpAreRefusedOnEveryRank) {
  const auto errors = run(false);
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    EXPECT_TRUE(has(e, "cohort: average_moe_gradients (rank ")) << "rank " << r << ": " << e;
    EXPECT_TRUE(has(e, "sequence (context-parallel) group")) << "rank " << r << ": " << e;
    EXPECT_TRUE(has(e, "mesh[{\"dp\", \"ep\", \"cp\"}]")) << "rank " << r << ": " << e;
    EXPECT_TRUE(has(e, "mesh[{\"dp\", \"cp\"}]")) << "rank " << r << ": " << e;
  }
}

TEST_P(MoeContextGroups, InputOfAnotherWidthOnOneRankIsRefusedOnEveryRank) {
  const Case k = GetParam();
  ThreadRanksOptions o;
  o.backend = k.backend;
  o.timeout = std::chrono::seconds(5);
  const auto errors = errors_on_every_rank(
      k.world(),
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(world, {k.dp, k.ep, k.cp}, {"dp", "ep", "cp"});
        MoE m(mesh, options());
        m(torch::zeros({3, world->rank() == 1 ? 5 : 4}));
      },
      o);
  // World rank 1 is cp rank 1 of dp 0, ep 0 in every case.
  for (int r = 0; r < k.world(); ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    const bool peer_of_1 = r < k.cp;  // the sequence group of rank 1
    if (r == 1 || peer_of_1 || (k.ep > 1 && r < k.ep * k.cp)) {
      EXPECT_TRUE(has(e, "the input's last dimension must be hidden = 4, got 5"))
          << "rank " << r << ": " << e;
    } else {
      EXPECT_EQ(e, kNoError) << "rank " << r;  // another dp replica
    }
    if (r == 1) {
      EXPECT_TRUE(has(e, "this rank's input: ")) << e;
    } else if (peer_of_1) {
      EXPECT_TRUE(has(e, "rank 1 of the sequence group ")) << e;
    } else if (k.ep > 1 && r == 2) {  // ep 1, cp 0: told by rank 0, relaying
      EXPECT_TRUE(has(e, "rank 1 of the sequence group of rank 0 of the expert-parallel group "))
          << e;
    } else if (k.ep > 1 && r == 3) {  // ep 1, cp 1: told by rank 1 itself
      EXPECT_TRUE(has(e, "rank 0 of the expert-parallel group ")) << e;
      EXPECT_FALSE(has(e, "of the sequence group")) << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeContextGroups, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::moe_context_groups_test
