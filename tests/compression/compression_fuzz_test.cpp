// Randomized trials of every compressor (none, fp16, bf16, int8, top-k,
// PowerSGD) on 1-3 ranks: sizes 0, 1, odd and large, matrices and vectors,
// steps of normal, zero, huge, NaN and inf values, settings and sizes that
// agree or differ across ranks. Each trial must either throw MismatchError
// on every rank (they differ) or finish on every rank with the same bits,
// finite wherever the step's inputs were finite on every rank. Built with
// -fsanitize=address (cohort/compression/README.md, "Tests") it also shows
// that nothing is read or written out of bounds.
//
// Seeded: every rank draws trial t from the same generator (seed
// kBaseSeed + t, or COHORT_FUZZ_SEED + t), so a failure names the trial
// that reproduces it.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>

#include "cohort/compression/compressor.h"
#include "support/thread_ranks.h"

namespace cohort::testing::compression_fuzz_test {
namespace {

using namespace cohort::compression;

constexpr uint64_t kBaseSeed = 20261124;
constexpr int kTrials = 120;

uint64_t base_seed() {
  const char* s = std::getenv("COHORT_FUZZ_SEED");
  return s ? std::strtoull(s, nullptr, 10) : kBaseSeed;
}

enum class Values { Normal, Zero, Huge, NaN, Inf, Mixed };

// One trial, the same on every rank: the options, the views' shapes, what
// each step holds, and (differ) which rank changes what.
struct Trial {
  CompressionOptions options;
  std::vector<std::vector<int64_t>> shapes;  // views of the flat tensor
  std::vector<std::vector<Values>> steps;    // [step][rank]
  int differ = 0;                            // 0: agree; 1: kind; 2: a setting of the kind; 3: size
};

template <typename T>
T pick(std::mt19937_64& g, std::initializer_list<T> xs) {
  return *(xs.begin() + std::uniform_int_distribution<size_t>(0, xs.size() - 1)(g));
}

Trial draw_trial(uint64_t seed, int p) {
  std::mt19937_64 g(seed);
  Trial t;
  auto& o = t.options;
  o.kind = pick(g, {CompressionKind::None, CompressionKind::Fp16, CompressionKind::Bf16,
                    CompressionKind::Int8, CompressionKind::TopK, CompressionKind::PowerSGD});
  o.error_feedback = pick(g, {false, true});
  o.int8_chunk = pick<int64_t>(g, {1, 3, 64, 2048});
  o.topk_ratio = pick(g, {1e-3, 0.1, 0.5, 1.0});
  o.powersgd_rank = pick(g, {1, 2, 4});
  o.powersgd_warm_start = pick(g, {false, true});
  const bool state = o.error_feedback || o.powersgd_warm_start;
  o.powersgd_start_iteration = state ? pick<int64_t>(g, {2, 3}) : pick<int64_t>(g, {0, 1, 2});
  o.powersgd_min_compression_rate = pick(g, {1.0, 2.0});
  o.powersgd_seed = pick<int64_t>(g, {0, 7});
  const bool tiny_chunks = o.kind == CompressionKind::Int8 && o.int8_chunk < 64;
  const int views = std::uniform_int_distribution<int>(1, 3)(g);
  for (int v = 0; v < views; ++v) {
    if (o.kind == CompressionKind::PowerSGD && pick(g, {false, true})) {
      t.shapes.push_back({pick<int64_t>(g, {1, 2, 7, 33}), pick<int64_t>(g, {1, 3, 8, 40})});
    } else if (tiny_chunks) {
      t.shapes.push_back({pick<int64_t>(g, {0, 1, 7, 1023})});
    } else {
      t.shapes.push_back({pick<int64_t>(g, {0, 1, 7, 1023, 20001})});
    }
  }
  const int steps = std::uniform_int_distribution<int>(1, 4)(g);
  for (int s = 0; s < steps; ++s) {
    t.steps.emplace_back();
    for (int r = 0; r < p; ++r) {
      t.steps.back().push_back(pick(g, {Values::Normal, Values::Normal, Values::Zero, Values::Huge,
                                        Values::NaN, Values::Inf, Values::Mixed}));
    }
  }
  t.differ = p > 1 && std::uniform_int_distribution<int>(0, 3)(g) == 0
                 ? std::uniform_int_distribution<int>(1, 3)(g)
                 : 0;
  return t;
}

// The last rank's version of a differing trial.
void make_differ(Trial& t) {
  auto& o = t.options;
  if (t.differ == 1) {
    o.kind = o.kind == CompressionKind::Int8 ? CompressionKind::TopK : CompressionKind::Int8;
    o.powersgd_start_iteration = 2;  // the kind is what differs, not validity
  } else if (t.differ == 2) {
    switch (o.kind) {
      case CompressionKind::Int8:
        o.int8_chunk += 1;
        break;
      case CompressionKind::TopK:
        o.topk_ratio /= 2;
        break;
      case CompressionKind::PowerSGD:
        o.powersgd_rank += 1;
        break;
      default:  // no settings: flip the wire format instead
        o.kind = o.kind == CompressionKind::Fp16 ? CompressionKind::Bf16 : CompressionKind::Fp16;
    }
  } else {
    t.shapes.back().back() += 1;
  }
}

at::Tensor values(Values kind, int64_t n, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto x = at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat));
  const float inf = std::numeric_limits<float>::infinity();
  switch (kind) {
    case Values::Normal:
      return x;
    case Values::Zero:
      return x.zero_();
    case Values::Huge:  // p of them still add up to a float
      return x.mul_(1e30f);
    case Values::NaN:
      return x.masked_fill_(x > 1.0f, std::numeric_limits<float>::quiet_NaN());
    case Values::Inf:
      return x.masked_fill_(x > 1.5f, inf).masked_fill_(x < -1.5f, -inf);
    case Values::Mixed:
      return x.masked_fill_(x > 2.0f, 1e30f).masked_fill_(x < -2.5f, inf);
  }
  return x;
}

bool finite_values(Values v) {
  return v == Values::Normal || v == Values::Zero || v == Values::Huge;
}

// Whether the kind can carry the step's values at all: fp16 saturates at
// 65504 (huge values become inf on the wire, as in PyTorch's fp16 hook).
bool representable(CompressionKind kind, Values v) {
  return !(kind == CompressionKind::Fp16 && v == Values::Huge);
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

class Fuzz : public ::testing::TestWithParam<int> {};

TEST_P(Fuzz, EveryCompressorSurvivesRandomTrials) {
  const int p = GetParam();
  const uint64_t base = base_seed();
  run_ranks(p, [&](Communicator& comm) {
    at::set_num_threads(1);
    const int r = comm.rank();
    // What the trials covered, so that a change to draw_trial cannot leave
    // the claims untested.
    int refused = 0, finite_after_non_finite = 0;
    for (int i = 0; i < kTrials; ++i) {
      const uint64_t seed = base + 1000 * static_cast<uint64_t>(p) + i;
      Trial t = draw_trial(seed, p);
      if (t.differ && r == p - 1) make_differ(t);
      SCOPED_TRACE("trial seed " + std::to_string(seed) + " (COHORT_FUZZ_SEED=" +
                   std::to_string(base) + ", world " + std::to_string(p) + ", kind " +
                   to_string(t.options.kind) + ", differ " + std::to_string(t.differ) + ")");
      auto c = make_compressor(t.options);
      int64_t n = 0;
      for (auto& s : t.shapes) n += numel_of(s);
      auto flat = at::empty({n}, at::kFloat);
      std::vector<at::Tensor> shaped;
      int64_t off = 0;
      for (auto& s : t.shapes) {
        shaped.push_back(flat.narrow(0, off, numel_of(s)).view(s));
        off += numel_of(s);
      }
      for (size_t s = 0; s < t.steps.size(); ++s) {
        flat.copy_(values(t.steps[s][r], n, seed * 31 + 7 * s + r));
        try {
          c->all_reduce(comm, flat, i, shaped);
        } catch (const MismatchError& e) {
          EXPECT_TRUE(t.differ) << "agreeing ranks refused: " << e.what();
          ++refused;
          break;  // every rank throws at the first step: the next trial
        }
        ASSERT_FALSE(t.differ) << "ranks differ, yet step " << s << " went through";
        // Every rank holds the same bits (NaN included).
        auto bits = flat.view(at::kInt);
        auto all = at::empty({p * n}, at::kInt);
        comm.all_gather_into_tensor(all, bits).wait();
        for (int q = 0; q < p; ++q) {
          ASSERT_TRUE(at::equal(all.narrow(0, q * n, n), bits)) << "rank " << q << " differs";
        }
        bool finite_in = true;
        for (auto v : t.steps[s]) {
          finite_in = finite_in && finite_values(v) && representable(t.options.kind, v);
        }
        if (finite_in) {
          ASSERT_TRUE(at::all(at::isfinite(flat)).item<bool>())
              << "finite inputs, non-finite output at step " << s;
          bool after_non_finite = false;
          for (size_t e = 0; e < s; ++e) {
            for (auto v : t.steps[e]) after_non_finite = after_non_finite || !finite_values(v);
          }
          finite_after_non_finite += after_non_finite;
        }
      }
    }
    EXPECT_GT(finite_after_non_finite, 10);
    if (p > 1) {
      EXPECT_GT(refused, 10);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Compression, Fuzz, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace cohort::testing::compression_fuzz_test
