// Compressors facing what a real run throws at them: ranks whose settings
// or sizes differ (an exception on every rank naming the setting, the ranks
// and the key, never an abort or a hang), a step with NaN or inf (the next
// finite step is normal), values near the float maximum (no sign flip), an
// all-zero step before PowerSGD (the layer's gradient is not 0 for good),
// and DDP's bucket rebuild (a bucket's state does not follow its index to
// other parameters).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <functional>
#include <limits>

#include "cohort/compression/compressed_collectives.h"
#include "cohort/compression/compressor.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"

namespace cohort::testing::compression_hardening_test {
namespace {

using namespace cohort::compression;

at::Tensor randn(uint64_t seed, int64_t n) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat));
}

CompressionOptions options_of(CompressionKind kind) {
  CompressionOptions o;
  o.kind = kind;
  o.int8_chunk = 64;
  o.topk_ratio = 0.1;
  o.powersgd_start_iteration = 2;
  o.powersgd_min_compression_rate = 1;
  return o;
}

// ---- Settings and sizes that differ across ranks ----

struct Disagreement {
  std::string name;
  std::function<CompressionOptions(int rank)> options;
  std::function<int64_t(int rank)> size;
  std::string setting;  // what the message must name
};

std::vector<Disagreement> disagreements() {
  auto same = [](int64_t n) { return [n](int) { return n; }; };
  auto kind_by_rank = [](CompressionKind first, CompressionKind rest,
                         std::function<void(CompressionOptions&, int)> tweak = {}) {
    return [=](int r) {
      auto o = options_of(r == 0 ? first : rest);
      if (tweak) tweak(o, r);
      return o;
    };
  };
  const auto int8 = CompressionKind::Int8, topk = CompressionKind::TopK,
             powersgd = CompressionKind::PowerSGD;
  return {
      {"kind", kind_by_rank(int8, topk), same(1000), "compression kind"},
      {"fp16_vs_none", kind_by_rank(CompressionKind::Fp16, CompressionKind::None), same(9),
       "compression kind"},
      {"int8_chunk", kind_by_rank(int8, int8, [](auto& o, int r) { o.int8_chunk = 64 >> r; }),
       same(1000), "int8_chunk"},
      {"topk_ratio", kind_by_rank(topk, topk, [](auto& o, int r) { o.topk_ratio = 0.1 * (r + 1); }),
       same(100), "topk_ratio"},
      {"powersgd_rank",
       kind_by_rank(powersgd, powersgd, [](auto& o, int r) { o.powersgd_rank = r + 1; }), same(96),
       "powersgd_rank"},
      {"int8_size", kind_by_rank(int8, int8), [](int r) { return int64_t{1000} - r; },
       "tensor size"},
      {"topk_size", kind_by_rank(topk, topk), [](int r) { return r == 0 ? 100 : 50; },
       "tensor size"},
      {"topk_empty_on_one", kind_by_rank(topk, topk), [](int r) { return r == 0 ? 0 : 7; },
       "tensor size"},
      {"powersgd_size", kind_by_rank(powersgd, powersgd), [](int r) { return 96 + 12 * r; },
       "tensor size"},
  };
}

class Disagree : public ::testing::TestWithParam<std::tuple<int, Disagreement>> {};

TEST_P(Disagree, EveryRankThrowsNamingTheSettingRanksAndKey) {
  const int p = std::get<0>(GetParam());
  const Disagreement d = std::get<1>(GetParam());
  run_ranks(p, [&](Communicator& comm) {
    at::set_num_threads(1);
    const int r = comm.rank();
    auto c = make_compressor(d.options(r));
    const int64_t n = d.size(r);
    auto t = randn(17 * r + 1, n).view({n / 12 > 0 && n % 12 == 0 ? n / 12 : 1, -1});
    try {
      compressed_all_reduce(comm, t, *c, /*key=*/7);
      ADD_FAILURE() << d.name << ": rank " << r << " did not throw";
    } catch (const MismatchError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(d.setting), std::string::npos) << m;
      EXPECT_NE(m.find("rank 0"), std::string::npos) << m;
      EXPECT_NE(m.find("rank 1"), std::string::npos) << m;
      EXPECT_NE(m.find("tensor key 7"), std::string::npos) << m;
    }
    // Nothing was sent but the fingerprint: the communicator goes on.
    auto agreed = make_compressor(options_of(CompressionKind::Int8));
    auto u = at::full({10}, static_cast<float>(r));
    compressed_all_reduce(comm, u, *agreed, 8);
    EXPECT_TRUE(at::allclose(u, at::full({10}, (p - 1) / 2.0f), 0, 0.02)) << u;
  });
}

INSTANTIATE_TEST_SUITE_P(Compression, Disagree,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::ValuesIn(disagreements())),
                         [](const auto& info) {
                           return std::get<1>(info.param).name + "_world" +
                                  std::to_string(std::get<0>(info.param));
                         });

// ---- One step with NaN or inf, then finite steps ----

class Kinds : public ::testing::TestWithParam<std::tuple<int, CompressionKind>> {};

// Int8 and top-k: the bad step leaves the error buffers finite and (inputs
// otherwise 0) empty, so the next step is bitwise a fresh compressor's.
TEST_P(Kinds, NonFiniteStepLeavesNoTrace) {
  const int p = std::get<0>(GetParam());
  const CompressionKind kind = std::get<1>(GetParam());
  if (kind == CompressionKind::PowerSGD) GTEST_SKIP() << "PowerSGD: LowRankAfterBadStep";
  constexpr int64_t kN = 301;
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  run_ranks(p, [&](Communicator& comm) {
    at::set_num_threads(1);
    const int r = comm.rank();
    auto c = make_compressor(options_of(kind));
    auto bad = at::zeros({kN}, at::kFloat);
    if (r == 0) bad.fill_(nan);  // every entry: more than top-k sends in a step
    if (r == p - 1) bad[70].fill_(inf);
    bad[200].fill_(-inf);
    compressed_all_reduce(comm, bad, *c);
    for (auto& [name, e] : c->state()) {
      EXPECT_TRUE(at::all(e == 0).item<bool>()) << name << " holds " << e;
    }
    for (int64_t step = 1; step < 4; ++step) {
      auto x = randn(100 * step + r, kN), y = x.clone();
      compressed_all_reduce(comm, x, *c);
      auto fresh = make_compressor(options_of(kind));
      compressed_all_reduce(comm, y, *fresh);
      EXPECT_TRUE(at::all(at::isfinite(x)).item<bool>()) << "step " << step;
      if (step == 1) {
        EXPECT_TRUE(at::equal(x, y)) << "step 1 differs from a fresh compressor's";
      }
    }
  });
}

// Values near the float maximum: the average of +3e38 is +3e38 or +inf,
// never negative (nor NaN), as the uncompressed average is.
TEST_P(Kinds, NearFloatMaxKeepsTheSign) {
  const int p = std::get<0>(GetParam());
  const CompressionKind kind = std::get<1>(GetParam());
  if (kind == CompressionKind::PowerSGD) GTEST_SKIP() << "P = MQ overflows: NaN, as documented";
  run_ranks(p, [&](Communicator& comm) {
    at::set_num_threads(1);
    auto c = make_compressor(options_of(kind));
    for (int64_t n : {1, 5, 3000}) {
      for (float sign : {1.0f, -1.0f}) {
        auto t = at::full({n}, sign * 3e38f);
        compressed_all_reduce(comm, t, *c, n * 2 + (sign > 0));
        // Top-k leaves what it did not send at 0 (in its error feedback).
        auto kept = kind == CompressionKind::TopK ? t.masked_select(t != 0) : t;
        EXPECT_TRUE(at::all(t * sign >= 0).item<bool>() && kept.numel() > 0 &&
                    at::all(kept * sign >= 1e38f).item<bool>())
            << to_string(kind) << " n " << n << " sign " << sign << ": " << t.min() << " "
            << t.max();
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Compression, Kinds,
    ::testing::Combine(::testing::Values(1, 2, 3),
                       ::testing::Values(CompressionKind::None, CompressionKind::Fp16,
                                         CompressionKind::Bf16, CompressionKind::Int8,
                                         CompressionKind::TopK, CompressionKind::PowerSGD)),
    [](const auto& info) {
      return to_string(std::get<1>(info.param)) + "_world" +
             std::to_string(std::get<0>(info.param));
    });

// ---- int8 chunks too small to scale ----

// The engines ranks as threads run on: Gloo, and UCX where it is built.
std::vector<std::string> thread_backends() {
  std::vector<std::string> out = {"gloo"};
#ifdef COHORT_WITH_UCX
  out.push_back("ucx");
#endif
  return out;
}

class Int8Tiny : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// Chunks whose largest |v| is 1e-39 (subnormal) or 1e-37: 127 / amax
// overflows float. The average of exact zeros is exactly 0 and of the tiny
// values at most their magnitude, for the plain collective and the
// compressor with error feedback, in both phases (owner and all-gather).
TEST_P(Int8Tiny, ZerosStayZeroAndTinyValuesStayTiny) {
  const auto& [backend, p] = GetParam();
  constexpr int64_t kChunk = 64, kNormal = 2 * kChunk, kTinyChunks = 4;
  constexpr int64_t kN = kNormal + kTinyChunks * kChunk;
  const float tiny[kTinyChunks] = {1e-39f, 1e-37f, 1e-39f, 1e-37f};
  ThreadRanksOptions ro;
  ro.backend = backend;
  run_ranks(
      p,
      [&](Communicator& comm) {
        at::set_num_threads(1);
        const int r = comm.rank();
        // Every third element of the tiny chunks is 0 on every rank; the
        // others are +-tiny (signs by rank and position).
        auto x = at::zeros({kN}, at::kFloat);
        x.narrow(0, 0, kNormal).copy_(randn(5 + r, kNormal));
        auto zero = at::zeros({kN}, at::kBool);
        for (int64_t c = 0; c < kTinyChunks; ++c) {
          for (int64_t i = 0; i < kChunk; ++i) {
            const int64_t k = kNormal + c * kChunk + i;
            if (i % 3 == 0) {
              zero[k] = true;
            } else {
              x[k] = ((i + r) % 2 ? 1.0f : -1.0f) * tiny[c];
            }
          }
        }
        const auto tiny_part = at::arange(kN) >= kNormal;
        for (bool compressor : {false, true}) {
          auto t = x.clone();
          if (compressor) {
            auto c = make_compressor(options_of(CompressionKind::Int8));
            compressed_all_reduce(comm, t, *c, 3);
          } else {
            int8_all_reduce(comm, t, kChunk, nullptr);
          }
          const std::string what = compressor ? "the compressor" : "int8_all_reduce";
          EXPECT_TRUE(at::all(at::isfinite(t)).item<bool>()) << what;
          EXPECT_TRUE(at::all(t.masked_select(zero) == 0).item<bool>())
              << what << ": zeros arrived as " << t.masked_select(zero).min();
          EXPECT_TRUE(at::all(t.masked_select(tiny_part).abs() <= 1e-37f).item<bool>())
              << what << ": tiny values arrived as " << t.masked_select(tiny_part).abs().max();
        }
      },
      ro);
}

INSTANTIATE_TEST_SUITE_P(Compression, Int8Tiny,
                         ::testing::Combine(::testing::ValuesIn(thread_backends()),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- PowerSGD after a step of NaN or of zeros ----

class PowerSGDBadStep : public ::testing::TestWithParam<std::tuple<int, float>> {};

// A 12 x 8 matrix (compressed at rank 1) and a vector of 5: two steps
// uncompressed, then the bad step, then an exactly rank-1 average u v^T,
// which rank-1 PowerSGD recovers in one step from any Q not orthogonal to
// v, unless the bad step left Q zero or NaN or the error buffer poisoned.
TEST_P(PowerSGDBadStep, LowRankAfterBadStep) {
  const int p = std::get<0>(GetParam());
  const float bad_value = std::get<1>(GetParam());
  run_ranks(p, [&](Communicator& comm) {
    at::set_num_threads(1);
    const int r = comm.rank();
    auto c = make_compressor(options_of(CompressionKind::PowerSGD));
    auto flat = at::empty({96 + 5}, at::kFloat);
    auto m = flat.narrow(0, 0, 96).view({12, 8});
    auto v = flat.narrow(0, 96, 5);
    auto step = [&] { c->all_reduce(comm, flat, 0, {m, v}); };
    for (int64_t s = 0; s < 2; ++s) {
      flat.copy_(randn(10 * s + r, 101));
      step();
    }
    flat.fill_(bad_value == bad_value ? bad_value : 0.0f);
    if (bad_value != bad_value && r == 0) m[3][4].fill_(bad_value);  // NaN on one rank
    step();
    for (int64_t s = 3; s < 5; ++s) {
      auto target = at::outer(randn(1000 + s, 12), randn(2000 + s, 8));
      m.copy_(target);
      v.copy_(randn(3000 + s + r, 5));
      auto v_avg = at::zeros({5});
      for (int i = 0; i < p; ++i) v_avg += randn(3000 + s + i, 5) / p;
      step();
      EXPECT_TRUE(at::allclose(m, target, 1e-4, 1e-5)) << "step " << s << ": " << m;
      EXPECT_TRUE(at::allclose(v, v_avg, 1e-5, 1e-5)) << "step " << s;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Compression, PowerSGDBadStep,
    ::testing::Combine(::testing::Values(1, 2, 3),
                       ::testing::Values(0.0f, std::numeric_limits<float>::quiet_NaN())),
    [](const auto& info) {
      const float b = std::get<1>(info.param);
      return std::string(b == b ? "zero" : "nan") + "_world" +
             std::to_string(std::get<0>(info.param));
    });

TEST(PowerSGDOptions, StartIterationAboveOneWithStateOnly) {
  for (bool feedback : {false, true}) {
    for (bool warm : {false, true}) {
      for (int64_t start : {0, 1, 2}) {
        CompressionOptions o;
        o.kind = CompressionKind::PowerSGD;
        o.error_feedback = feedback;
        o.powersgd_warm_start = warm;
        o.powersgd_start_iteration = start;
        if ((feedback || warm) && start <= 1) {
          try {
            make_compressor(o);
            ADD_FAILURE() << "start " << start << " accepted";
          } catch (const InvalidArgument& e) {
            EXPECT_NE(std::string(e.what()).find("powersgd_start_iteration"), std::string::npos);
          }
        } else {
          EXPECT_NO_THROW(make_compressor(o));
        }
      }
    }
  }
}

// ---- DDP's bucket rebuild ----

// Two vectors of the same size, one bucket each. Registered a, b, the
// buckets start as [b], [a]; the forward makes a's gradient ready first, so
// the rebuild after the first iteration makes them [a], [b]: same sizes,
// other contents.
struct TwoVectorsImpl : torch::nn::Module {
  explicit TwoVectorsImpl(int64_t n) {
    a = register_parameter("a", torch::zeros({n}));
    b = register_parameter("b", torch::zeros({n}));
  }
  torch::Tensor forward(const torch::Tensor& xa, const torch::Tensor& xb) {
    auto lb = (xb * b).sum();
    return lb + (xa * a).sum();
  }
  torch::Tensor a, b;
};
TORCH_MODULE(TwoVectors);

class Rebuild : public ::testing::TestWithParam<std::tuple<int, CompressionKind>> {};

// After the rebuild each bucket is reduced as by a fresh compressor: the
// state of b's bucket is not added to a's gradient.
TEST_P(Rebuild, ChangedBucketStartsAfresh) {
  const int p = std::get<0>(GetParam());
  const CompressionKind kind = std::get<1>(GetParam());
  constexpr int64_t kN = 41;
  run_ranks_shared(p, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const int r = comm->rank();
    TwoVectors model(kN);
    DDPOptions o;
    o.bucket_cap_mb = o.first_bucket_mb = 1e-6;  // one parameter per bucket
    o.compression = options_of(kind);
    DistributedDataParallel<TwoVectors> ddp(model, comm, o);
    const auto before = ddp.reducer().bucket_layout();
    for (int64_t it = 0; it < 2; ++it) {
      model->zero_grad();
      auto xa = randn(100 * it + r, kN), xb = randn(100 * it + r + 50, kN);
      ddp.forward(xa, xb).backward();
      if (it == 0) continue;
      ASSERT_NE(ddp.reducer().bucket_layout(), before) << "no rebuild: the test proves nothing";
      ASSERT_EQ(ddp.reducer().bucket_layout()[0], std::vector<size_t>{0});
      auto fresh = make_compressor(options_of(kind));
      compressed_all_reduce(*comm, xa, *fresh, 0);
      EXPECT_TRUE(torch::equal(model->a.grad(), xa)) << model->a.grad() - xa;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Compression, Rebuild,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::Values(CompressionKind::Int8,
                                                              CompressionKind::TopK)),
                         [](const auto& info) {
                           return to_string(std::get<1>(info.param)) + "_world" +
                                  std::to_string(std::get<0>(info.param));
                         });

}  // namespace
}  // namespace cohort::testing::compression_hardening_test
