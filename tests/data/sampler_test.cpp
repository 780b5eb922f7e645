// cohort::data::DistributedSampler against PyTorch's own
// torch.utils.data.DistributedSampler: for every world (1, 2, 3), dataset
// size (0, 1, 2, 7, 10), shuffle and drop_last, each rank's indices in
// epochs 0, 1 and 2 are PyTorch's (computed by the Python peer, never
// written here). Then through a real torch::data::make_data_loader, which
// holds its own copy of the sampler: set_epoch on the caller's copy changes
// the loader's order, and across the ranks every sample is seen once per
// epoch (the padded ones twice; with drop_last, the tail left out); without
// set_epoch every pass deals epoch 0's order, as PyTorch's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cohort/data/distributed_sampler.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"

namespace cohort::testing::sampler_test {
namespace {

using data::DistributedSampler;
using data::DistributedSamplerOptions;
using Indices = std::vector<size_t>;

constexpr uint64_t kSeed = 5;
constexpr int kEpochs = 3;
const std::vector<int> kWorlds = {1, 2, 3};
const std::vector<size_t> kSizes = {0, 1, 2, 7, 10};  // 2: one short of world 3

std::string key(size_t size, int world, bool shuffle, bool drop_last, int64_t epoch, int rank) {
  std::ostringstream k;
  k << size << ' ' << world << ' ' << shuffle << ' ' << drop_last << ' ' << kSeed << ' ' << epoch
    << ' ' << rank;
  return k.str();
}

// Every case's indices by key(), from one run of the Python peer; empty
// (with `skip` set) when /usr/bin/python3 has no torch.
struct Reference {
  std::map<std::string, Indices> indices;
  std::string skip;
  std::string error;
};

const Reference& reference() {
  static const Reference ref = [] {
    Reference r;
    TempDir dir("cohort-sampler-ref");
    {
      std::ofstream cases(dir / "cases");
      for (int world : kWorlds)
        for (size_t size : kSizes)
          for (int shuffle = 0; shuffle < 2; ++shuffle)
            for (int drop = 0; drop < 2; ++drop)
              cases << size << ' ' << world << ' ' << shuffle << ' ' << drop << ' ' << kSeed << ' '
                    << kEpochs << '\n';
    }
    const auto result = run_process({"/bin/sh", "-c",
                                     std::string(SAMPLER_REFERENCE_PYTHON) + " " +
                                         SAMPLER_REFERENCE_SCRIPT + " < " + (dir / "cases")},
                                    Seconds(120), {"OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1"});
    if (result.exit_code != 0) {
      if (result.err.find("No module named 'torch'") != std::string::npos) {
        r.skip = SAMPLER_REFERENCE_PYTHON " has no torch";
      } else {
        r.error =
            "the reference failed (exit " + std::to_string(result.exit_code) + "): " + result.err;
      }
      return r;
    }
    std::istringstream lines(result.out);
    for (std::string line; std::getline(lines, line);) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      std::istringstream values(line.substr(colon + 1));
      Indices got;
      for (size_t v; values >> v;) got.push_back(v);
      r.indices[line.substr(0, colon)] = got;
    }
    return r;
  }();
  return ref;
}

// The reference for one rank and epoch, or a failure naming the case.
const Indices* expected(const std::string& k) {
  const auto& ref = reference();
  EXPECT_TRUE(ref.error.empty()) << ref.error;
  auto it = ref.indices.find(k);
  EXPECT_NE(it, ref.indices.end()) << "no reference for " << k;
  return it == ref.indices.end() ? nullptr : &it->second;
}

// What a sampler hands out in one epoch, in batches of `batch`.
Indices drain(DistributedSampler& sampler, size_t batch) {
  Indices all;
  while (auto b = sampler.next(batch)) {
    EXPECT_LE(b->size(), batch);
    all.insert(all.end(), b->begin(), b->end());
  }
  return all;
}

using Param = std::tuple<int, size_t, bool, bool>;  // world, size, shuffle, drop_last

class SamplerGolden : public ::testing::TestWithParam<Param> {};

TEST_P(SamplerGolden, EveryRankAndEpochIsPyTorchs) {
  if (!reference().skip.empty()) GTEST_SKIP() << reference().skip;
  const auto [world, size, shuffle, drop_last] = GetParam();
  for (int rank = 0; rank < world; ++rank) {
    DistributedSamplerOptions o;
    o.num_replicas = world;
    o.rank = rank;
    o.shuffle = shuffle;
    o.seed = kSeed;
    o.drop_last = drop_last;
    DistributedSampler sampler(size, o);
    for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
      const auto k = key(size, world, shuffle, drop_last, epoch, rank);
      const auto* want = expected(k);
      if (!want) return;
      sampler.set_epoch(epoch);
      sampler.reset();
      EXPECT_EQ(sampler.num_samples(), want->size()) << k;
      EXPECT_EQ(sampler.total_size(), want->size() * static_cast<size_t>(world)) << k;
      EXPECT_EQ(sampler.indices(), *want) << k;
      EXPECT_EQ(drain(sampler, 3), *want) << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllCases, SamplerGolden,
                         ::testing::Combine(::testing::ValuesIn(kWorlds),
                                            ::testing::ValuesIn(kSizes), ::testing::Bool(),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) + "_size" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_shuffle" : "_ordered") +
                                  (std::get<3>(info.param) ? "_droplast" : "_pad");
                         });

// Sample i is the tensor {i}.
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
  explicit IndexDataset(size_t n) : n(n) {}
  torch::data::Example<> get(size_t i) override {
    return {torch::tensor({static_cast<int64_t>(i)}), torch::zeros({1})};
  }
  c10::optional<size_t> size() const override { return n; }
  size_t n;
};

class SamplerLoader : public ::testing::TestWithParam<std::tuple<int, size_t, bool>> {};

TEST_P(SamplerLoader, EpochsDifferAndEverySampleIsSeenOncePerEpoch) {
  if (!reference().skip.empty()) GTEST_SKIP() << reference().skip;
  const auto [world, size, drop_last] = GetParam();
  // seen[epoch][rank]: the order the loader gave that rank.
  std::vector<std::vector<Indices>> seen(kEpochs, std::vector<Indices>(world));
  run_ranks(world, [&, world = world, size = size, drop_last = drop_last](Communicator& comm) {
    DistributedSamplerOptions o;
    o.seed = kSeed;
    o.drop_last = drop_last;
    DistributedSampler sampler(size, comm, o);  // num_replicas and rank from comm
    auto loader =
        torch::data::make_data_loader(IndexDataset(size).map(torch::data::transforms::Stack<>()),
                                      sampler, torch::data::DataLoaderOptions(4));
    for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
      sampler.set_epoch(epoch);  // the caller's copy; the loader holds another
      for (auto& batch : *loader) {
        for (int64_t i = 0; i < batch.data.size(0); ++i) {
          seen[epoch][comm.rank()].push_back(static_cast<size_t>(batch.data[i][0].item<int64_t>()));
        }
      }
    }
  });
  const size_t r = static_cast<size_t>(world);
  const size_t total = drop_last ? size / r * r : (size + r - 1) / r * r;
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    std::map<size_t, int> count;
    for (int rank = 0; rank < world; ++rank) {
      const auto* want = expected(key(size, world, true, drop_last, epoch, rank));
      ASSERT_NE(want, nullptr);
      EXPECT_EQ(seen[epoch][rank], *want) << "epoch " << epoch << " rank " << rank;
      for (auto i : seen[epoch][rank]) ++count[i];
      if (epoch > 0) {
        EXPECT_NE(seen[epoch][rank], seen[epoch - 1][rank])
            << "rank " << rank << ": epochs " << epoch - 1 << " and " << epoch << " alike";
      }
    }
    // Padded: total - size samples twice, the rest once. Dropped: total
    // samples once, size - total never.
    int once = 0, twice = 0;
    for (const auto& [i, c] : count) {
      ASSERT_LT(i, size);
      once += c == 1;
      twice += c == 2;
      ASSERT_LE(c, 2) << "sample " << i;
    }
    EXPECT_EQ(twice, drop_last ? 0 : static_cast<int>(total - size)) << "epoch " << epoch;
    EXPECT_EQ(once + 2 * twice, static_cast<int>(total)) << "epoch " << epoch;
    EXPECT_EQ(static_cast<int>(count.size()), static_cast<int>(drop_last ? total : size));
  }
}

// Size 10 over 3 ranks: two samples padded, or one dropped; over 2 an even split.
INSTANTIATE_TEST_SUITE_P(Worlds, SamplerLoader,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(10),
                                            ::testing::Bool()));

// A program that never calls set_epoch: every pass of the loader deals
// epoch 0's order, as PyTorch's sampler does without set_epoch (its
// `epoch` stays 0), not a fresh order and not an error.
TEST(SamplerLoaderWithoutSetEpoch, EveryEpochDealsEpochZerosOrder) {
  if (!reference().skip.empty()) GTEST_SKIP() << reference().skip;
  const int world = 2;
  std::vector<std::vector<Indices>> seen(kEpochs, std::vector<Indices>(world));
  run_ranks(world, [&](Communicator& comm) {
    DistributedSamplerOptions o;
    o.seed = kSeed;
    DistributedSampler sampler(10, comm, o);
    auto loader =
        torch::data::make_data_loader(IndexDataset(10).map(torch::data::transforms::Stack<>()),
                                      sampler, torch::data::DataLoaderOptions(4));
    for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
      for (auto& batch : *loader) {
        for (int64_t i = 0; i < batch.data.size(0); ++i) {
          seen[epoch][comm.rank()].push_back(static_cast<size_t>(batch.data[i][0].item<int64_t>()));
        }
      }
    }
  });
  for (int rank = 0; rank < world; ++rank) {
    const auto* first = expected(key(10, world, true, false, 0, rank));
    const auto* second = expected(key(10, world, true, false, 1, rank));
    ASSERT_NE(first, nullptr);
    ASSERT_NE(second, nullptr);
    ASSERT_NE(*first, *second) << "the reference's epochs 0 and 1 are alike";
    for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
      EXPECT_EQ(seen[epoch][rank], *first) << "epoch " << epoch << " rank " << rank;
    }
  }
}

TEST(SamplerOptions, OutOfRangeRankIsRefused) {
  DistributedSamplerOptions o;
  o.num_replicas = 3;
  o.rank = 3;
  EXPECT_THROW(DistributedSampler(10, o), InvalidArgument);
  o.rank.reset();
  EXPECT_THROW(DistributedSampler(10, o), InvalidArgument);  // no communicator to ask
}

// save/load: the position continues with the samples the saved sampler
// would have given next; under other settings the same position names
// other samples, so it is refused.
TEST(SamplerState, LoadContinuesWhereSaveStoppedAndRefusesOtherSettings) {
  DistributedSamplerOptions o;
  o.num_replicas = 2;
  o.rank = 0;
  o.seed = 3;
  DistributedSampler a(100, o);
  a.set_epoch(4);
  a.reset();
  for (int i = 0; i < 10; ++i) a.next(3);
  torch::serialize::OutputArchive out;
  a.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  const auto expected = *a.next(5);

  auto load_into = [&](DistributedSampler& s) {
    torch::serialize::InputArchive in;
    std::istringstream is(bytes.str());
    in.load_from(is);
    s.load(in);
  };
  DistributedSampler b(100, o);
  load_into(b);
  EXPECT_EQ(b.epoch(), 4);
  EXPECT_EQ(*b.next(5), expected);

  auto refused = [&](size_t size, DistributedSamplerOptions other, const std::string& field) {
    DistributedSampler c(size, other);
    try {
      load_into(c);
      ADD_FAILURE() << field << ": loaded";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("saved with " + field), std::string::npos) << e.what();
    }
  };
  auto four = o;
  four.num_replicas = 4;
  refused(100, four, "num_replicas 2");
  auto seed = o;
  seed.seed = 4;
  refused(100, seed, "seed 3");
  auto ordered = o;
  ordered.shuffle = false;
  refused(100, ordered, "shuffle 1");
  auto drop = o;
  drop.drop_last = true;
  refused(100, drop, "drop_last 0");
  refused(120, o, "dataset_size 100");
}

}  // namespace
}  // namespace cohort::testing::sampler_test
