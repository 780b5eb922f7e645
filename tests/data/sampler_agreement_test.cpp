// The agreement of DistributedSampler's constructor with a Communicator:
// ranks that pass a different dataset size, seed, shuffle, drop_last or
// num_replicas would each deal their share of another order, so some
// samples would be trained on twice and others never, with nothing to show
// for it. Each such case (one rank apart, the last) is refused with an
// InvalidArgument on every rank that names the field and each group of
// ranks with its value; so are explicit ranks that leave a replica to no
// rank or give one to two, and a rank out of range on one rank only. Ranks
// as threads, over every engine at worlds 1 to 3; at world 1 nothing can
// differ, so the sampler is built as without the check.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cohort/data/distributed_sampler.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"

namespace cohort::testing::sampler_agreement_test {
namespace {

using data::DistributedSampler;
using data::DistributedSamplerOptions;

constexpr size_t kSize = 10;

// What each rank threw building its sampler with `options_of(rank)` over
// `size_of(rank)` samples: "InvalidArgument: <message>" for the error
// expected, the message alone for any other, kNoError for none.
std::vector<std::string> build_on_every_rank(
    const EngineWorld& c, const std::function<size_t(int)>& size_of,
    const std::function<DistributedSamplerOptions(int)>& options_of) {
  auto options = options_for(c);
  options.timeout = std::chrono::seconds(3);
  return errors_on_every_rank(
      c.world,
      [&](std::shared_ptr<Communicator> comm) {
        try {
          DistributedSampler sampler(size_of(comm->rank()), *comm, options_of(comm->rank()));
        } catch (const InvalidArgument& e) {
          throw std::runtime_error(std::string("InvalidArgument: ") + e.what());
        }
      },
      options);
}

// "ranks 0, 1: a; rank 2: b": how the message groups the ranks when the last
// rank alone passed `b`.
std::string last_apart(int world, const std::string& a, const std::string& b) {
  std::string groups = world > 2 ? "ranks " : "rank ";
  for (int r = 0; r < world - 1; ++r) groups += (r ? ", " : "") + std::to_string(r);
  return groups + ": " + a + "; rank " + std::to_string(world - 1) + ": " + b;
}

// Every rank refused with an InvalidArgument holding each of `parts`, or,
// at world 1 (no rank to differ), none refused.
void expect_refused_everywhere(const EngineWorld& c, const std::vector<std::string>& errors,
                               const std::vector<std::string>& parts) {
  ASSERT_EQ(static_cast<int>(errors.size()), c.world);
  for (int r = 0; r < c.world; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    if (c.world == 1) {
      EXPECT_EQ(e, kNoError) << "rank " << r;
      continue;
    }
    EXPECT_EQ(e.rfind("InvalidArgument: DistributedSampler on rank " + std::to_string(r), 0), 0u)
        << "rank " << r << ": " << e;
    for (const auto& part : parts) {
      EXPECT_NE(e.find(part), std::string::npos)
          << "rank " << r << " lacks '" << part << "': " << e;
    }
  }
}

class SamplerAgreement : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(SamplerAgreement, RanksThatAgreeGetThePlainSampler) {
  const auto c = GetParam();
  std::vector<std::vector<size_t>> got(static_cast<size_t>(c.world));
  auto options = options_for(c);
  run_ranks(
      c.world,
      [&](Communicator& comm) {
        DistributedSamplerOptions o;
        o.seed = 7;
        o.drop_last = true;
        got[static_cast<size_t>(comm.rank())] = DistributedSampler(kSize, comm, o).indices();
      },
      options);
  for (int r = 0; r < c.world; ++r) {
    DistributedSamplerOptions o;
    o.num_replicas = c.world;
    o.rank = r;
    o.seed = 7;
    o.drop_last = true;
    EXPECT_EQ(got[static_cast<size_t>(r)], DistributedSampler(kSize, o).indices()) << "rank " << r;
  }
}

// One field apart on the last rank: its size or options, the others', and
// how the message names the two values.
struct FieldApart {
  std::string name;  // the test's
  std::function<size_t(bool last)> size;
  std::function<DistributedSamplerOptions(bool last)> options;
  std::string field, others, last;
};

std::vector<FieldApart> fields_apart() {
  auto plain = [](bool) { return DistributedSamplerOptions{}; };
  auto same_size = [](bool) { return kSize; };
  auto with = [](auto set) {
    return [set](bool last) {
      DistributedSamplerOptions o;
      set(o, last);
      return o;
    };
  };
  return {
      {"DatasetSize", [](bool last) { return last ? kSize + 2 : kSize; }, plain, "dataset_size",
       "10", "12"},
      {"Seed", same_size,
       with([](DistributedSamplerOptions& o, bool last) { o.seed = last ? ~uint64_t{0} : 5; }),
       "seed", "5", "18446744073709551615"},  // printed unsigned
      {"Shuffle", same_size,
       with([](DistributedSamplerOptions& o, bool last) { o.shuffle = !last; }), "shuffle", "true",
       "false"},
      {"DropLast", same_size,
       with([](DistributedSamplerOptions& o, bool last) { o.drop_last = last; }), "drop_last",
       "false", "true"},
  };
}

using FieldParam = std::tuple<EngineWorld, size_t>;
class SamplerFieldApart : public ::testing::TestWithParam<FieldParam> {};

TEST_P(SamplerFieldApart, IsRefusedOnEveryRank) {
  const auto& [c, index] = GetParam();
  const auto f = fields_apart()[index];
  const int last = c.world - 1;
  const auto errors = build_on_every_rank(
      c, [&](int rank) { return f.size(rank == last); },
      [&](int rank) { return f.options(rank == last); });
  expect_refused_everywhere(c, errors,
                            {f.field + " (" + last_apart(c.world, f.others, f.last) + ")"});
}

INSTANTIATE_TEST_SUITE_P(Engines, SamplerFieldApart,
                         ::testing::Combine(::testing::ValuesIn(engine_worlds({1, 2, 3})),
                                            ::testing::Range<size_t>(0, fields_apart().size())),
                         [](const ::testing::TestParamInfo<FieldParam>& info) {
                           return engine_world_name({std::get<0>(info.param), info.index}) + "_" +
                                  fields_apart()[std::get<1>(info.param)].name;
                         });

// Several fields apart are all named.
TEST_P(SamplerAgreement, EveryFieldApartIsNamed) {
  const auto c = GetParam();
  const int last = c.world - 1;
  const auto errors = build_on_every_rank(
      c, [&](int rank) { return rank == last ? kSize - 1 : kSize; },
      [&](int rank) {
        DistributedSamplerOptions o;
        o.seed = rank == last ? 9 : 0;
        return o;
      });
  expect_refused_everywhere(c, errors,
                            {"dataset_size (" + last_apart(c.world, "10", "9") + ")",
                             "seed (" + last_apart(c.world, "0", "9") + ")"});
}

// The last rank sets num_replicas one above the world (its rank its own);
// the others take the communicator's. At world 1 the one rank agrees with
// itself, but no rank takes replica 1: refused too.
TEST_P(SamplerAgreement, NumReplicasApartIsRefusedOnEveryRank) {
  const auto c = GetParam();
  const int last = c.world - 1;
  const auto errors = build_on_every_rank(
      c, [](int) { return kSize; },
      [&](int rank) {
        DistributedSamplerOptions o;
        if (rank == last) {
          o.num_replicas = c.world + 1;
          o.rank = rank;
        }
        return o;
      });
  if (c.world == 1) {
    ASSERT_EQ(errors.size(), 1u);
    const auto& e = errors[0];
    EXPECT_EQ(e.rfind("InvalidArgument: DistributedSampler on rank 0", 0), 0u) << e;
    EXPECT_NE(e.find("num_replicas 2"), std::string::npos) << e;
    EXPECT_NE(e.find("no rank takes replica 1"), std::string::npos) << e;
    return;
  }
  expect_refused_everywhere(
      c, errors,
      {"num_replicas (" +
       last_apart(c.world, std::to_string(c.world), std::to_string(c.world + 1)) + ")"});
}

// The last rank claims rank 0, which rank 0 has already: replica 0 would be
// dealt twice and the last rank's replica never.
TEST_P(SamplerAgreement, TwoRanksClaimingOneRankAreRefusedOnEveryRank) {
  const auto c = GetParam();
  const int last = c.world - 1;
  const auto errors = build_on_every_rank(
      c, [](int) { return kSize; },
      [&](int rank) {
        DistributedSamplerOptions o;
        o.rank = rank == last ? 0 : rank;
        return o;
      });
  std::string groups;
  if (c.world == 2) groups = "ranks 0, 1: 0";
  if (c.world == 3) groups = "ranks 0, 2: 0; rank 1: 1";
  expect_refused_everywhere(
      c, errors, {"rank (" + groups + ")", "no rank takes replica " + std::to_string(last)});
}

// One rank's rank out of range would throw on that rank alone, leaving the
// others in the agreement until their timeout.
TEST_P(SamplerAgreement, OneRanksRankOutOfRangeIsRefusedOnEveryRank) {
  const auto c = GetParam();
  const int last = c.world - 1;
  const auto errors = build_on_every_rank(
      c, [](int) { return kSize; },
      [&](int rank) {
        DistributedSamplerOptions o;
        if (rank == last) o.rank = c.world;
        return o;
      });
  for (int r = 0; r < c.world; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_EQ(e.rfind("InvalidArgument: DistributedSampler on rank " + std::to_string(r), 0), 0u)
        << "rank " << r << ": " << e;
    EXPECT_NE(e.find("rank " + std::to_string(last) + " asks for rank " + std::to_string(c.world) +
                     ", out of range for num_replicas " + std::to_string(c.world)),
              std::string::npos)
        << "rank " << r << ": " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, SamplerAgreement, ::testing::ValuesIn(engine_worlds({1, 2, 3})),
                         engine_world_name);

// A tensor-parallel pair shares its data: 4 ranks over num_replicas 2, each
// replica taken by two ranks, is dealt evenly and accepted; 3 ranks on one
// replica and 1 on the other would weigh one share thrice, and is refused.
TEST(SamplerAgreementShared, ReplicasTakenEvenlyAreAcceptedUnevenlyRefused) {
  const EngineWorld c{"gloo", 4};
  auto even = build_on_every_rank(
      c, [](int) { return kSize; },
      [](int rank) {
        DistributedSamplerOptions o;
        o.num_replicas = 2;
        o.rank = rank / 2;
        return o;
      });
  EXPECT_EQ(even, std::vector<std::string>(4, kNoError));
  auto uneven = build_on_every_rank(
      c, [](int) { return kSize; },
      [](int rank) {
        DistributedSamplerOptions o;
        o.num_replicas = 2;
        o.rank = rank == 3 ? 1 : 0;
        return o;
      });
  for (int r = 0; r < 4; ++r) {
    EXPECT_NE(uneven[static_cast<size_t>(r)].find("rank (ranks 0, 1, 2: 0; rank 3: 1)"),
              std::string::npos)
        << "rank " << r << ": " << uneven[static_cast<size_t>(r)];
  }
}

}  // namespace
}  // namespace cohort::testing::sampler_agreement_test
