// Compressed collectives and compressors over ranks as threads (world 1-4,
// sizes 0, 1, smaller than a chunk, several chunks): round-trip error within
// each format's bound against the exact average, every rank ending with the
// same values, error feedback losing nothing over many steps, PowerSGD
// exact on low-rank input, and state() / load_state() resuming bitwise.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "cohort/compression/compressed_collectives.h"
#include "cohort/compression/compressor.h"
#include "support/thread_ranks.h"

namespace cohort::testing::compression_test {
namespace {

using namespace cohort::compression;

// Rank r's input of `n` elements for `step` (reproducible on any rank).
at::Tensor input(int r, int64_t n, int64_t step = 0) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * step + 17 * r + n));
  return at::randn({n}, gen, at::TensorOptions().dtype(at::kFloat));
}

// Every rank holds the same `t` (all-gathered and compared bitwise).
void expect_same_on_all_ranks(Communicator& comm, const at::Tensor& t) {
  auto all = at::empty({comm.size() * t.numel()}, at::kFloat);
  comm.all_gather_into_tensor(all, t.reshape(-1)).wait();
  for (int i = 0; i < comm.size(); ++i) {
    EXPECT_TRUE(at::equal(all.narrow(0, i * t.numel(), t.numel()), t.reshape(-1)))
        << "rank " << comm.rank() << " differs from rank " << i;
  }
}

const std::vector<int64_t> kSizes = {0, 1, 5, 1000};

class Worlds : public ::testing::TestWithParam<int> {};

TEST_P(Worlds, LowPrecisionWithinRoundingBound) {
  const int p = GetParam();
  run_ranks(p, [&](Communicator& comm) {
    at::set_num_threads(1);
    for (auto [wire, u] : {std::pair{at::kHalf, 0x1p-11}, std::pair{at::kBFloat16, 0x1p-8}}) {
      for (int64_t n : kSizes) {
        auto exact = at::zeros({n}, at::kDouble), magnitude = at::zeros({n}, at::kDouble);
        for (int r = 0; r < p; ++r) {
          exact += input(r, n).to(at::kDouble) / p;
          magnitude += input(r, n).to(at::kDouble).abs() / p;
        }
        auto buf = input(comm.rank(), n);
        low_precision_all_reduce(comm, buf, wire);
        // Each of the p-1 hops rounds a partial sum (at most `magnitude`),
        // the all-gather rounds the result once more.
        auto bound = u * (p * magnitude + exact.abs()) * 1.01 + 1e-7;
        auto err = (buf.to(at::kDouble) - exact).abs();
        EXPECT_TRUE(at::all(err <= bound).item<bool>()) << "n " << n << " wire " << wire;
        if (n == 1000) {
          EXPECT_GT(err.max().item<double>(), 0) << "no rounding seen";
        }
        expect_same_on_all_ranks(comm, buf);
      }
    }
  });
}

// The float16/bfloat16 ring's arithmetic replayed in one process: block b's
// partial sum starts at rank b+1 and makes p-1 hops, each cast to the wire
// dtype and added in float32 by the receiver; the all-gather carries the
// owner's sum cast once more. Blocks as the ring cuts them: the first n % p
// ranks' one element longer.
at::Tensor low_precision_reference(int p, int64_t n, at::ScalarType wire) {
  std::vector<at::Tensor> xs;
  for (int r = 0; r < p; ++r) xs.push_back(input(r, n).div_(p));
  auto expected = at::empty({n}, at::kFloat);
  int64_t offset = 0;
  for (int b = 0; b < p; ++b) {
    const int64_t count = n / p + (b < n % p ? 1 : 0);
    auto block = [&](int r) { return xs[r % p].narrow(0, offset, count); };
    at::Tensor partial = block(b + 1).clone();
    for (int k = 2; k <= p; ++k) partial = block(b + k) + partial.to(wire).to(at::kFloat);
    expected.narrow(0, offset, count).copy_(partial.to(wire).to(at::kFloat));
    offset += count;
  }
  return expected;
}

TEST_P(Worlds, LowPrecisionEqualsRingReference) {
  const int p = GetParam();
  run_ranks(p, [&](Communicator& comm) {
    at::set_num_threads(1);
    for (auto wire : {at::kHalf, at::kBFloat16}) {
      for (int64_t n : kSizes) {
        auto buf = input(comm.rank(), n);
        low_precision_all_reduce(comm, buf, wire);
        EXPECT_TRUE(at::equal(buf, low_precision_reference(p, n, wire)))
            << "n " << n << " wire " << wire;
      }
    }
  });
}

// Per element: phase 1 rounds each rank's value to half its chunk's scale,
// phase 2 rounds the average to half of the averaged chunk's scale.
at::Tensor int8_bound(const std::vector<at::Tensor>& xs, int64_t chunk) {
  const int64_t n = xs[0].numel(), chunks = (n + chunk - 1) / chunk;
  const int p = static_cast<int>(xs.size());
  auto chunk_max = [&](const at::Tensor& x) {
    auto padded = at::constant_pad_nd(x.abs(), {0, chunks * chunk - n}).view({chunks, chunk});
    return padded.amax(1).repeat_interleave(chunk).narrow(0, 0, n);
  };
  auto phase1 = at::zeros({n}, at::kDouble), avg = at::zeros({n}, at::kDouble);
  for (auto& x : xs) {
    phase1 += chunk_max(x.to(at::kDouble)) / (254.0 * p);
    avg += x.to(at::kDouble) / p;
  }
  auto phase2 = chunk_max(avg.abs() + phase1) / 254.0;
  return (phase1 + phase2) * 1.001 + 1e-6;
}

TEST_P(Worlds, Int8WithinQuantizationBound) {
  const int p = GetParam();
  constexpr int64_t kChunk = 16;
  run_ranks(p, [&](Communicator& comm) {
    at::set_num_threads(1);
    for (int64_t n : kSizes) {
      std::vector<at::Tensor> xs;
      auto exact = at::zeros({n}, at::kDouble);
      for (int r = 0; r < p; ++r) {
        xs.push_back(input(r, n));
        exact += xs.back().to(at::kDouble) / p;
      }
      // One segment, and segments of 3 chunks (several, some owners empty).
      for (int64_t segment_chunks : {64, 3}) {
        auto buf = input(comm.rank(), n);
        int8_all_reduce(comm, buf, kChunk, nullptr, segment_chunks);
        auto err = (buf.to(at::kDouble) - exact).abs();
        EXPECT_TRUE(at::all(err <= int8_bound(xs, kChunk)).item<bool>())
            << "n " << n << " segment_chunks " << segment_chunks;
        if (n == 1000) {
          EXPECT_GT(err.max().item<double>(), 0) << "no rounding seen";
        }
        expect_same_on_all_ranks(comm, buf);
      }
    }
  });
}

TEST_P(Worlds, TopKSendsTheLargestEntriesOfEachRank) {
  const int p = GetParam();
  run_ranks(p, [&](Communicator& comm) {
    at::set_num_threads(1);
    CompressionOptions o;
    o.kind = CompressionKind::TopK;
    o.topk_ratio = 0.1;
    o.error_feedback = false;
    auto c = make_compressor(o);
    for (int64_t n : kSizes) {
      const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(0.1 * n)));
      auto expected = at::zeros({n}, at::kFloat);
      for (int r = 0; r < p && n > 0; ++r) {
        auto x = input(r, n);
        auto idx = std::get<1>(x.abs().topk(k));
        expected.index_add_(0, idx, x.index_select(0, idx));
      }
      expected.div_(p);
      auto buf = input(comm.rank(), n);
      compressed_all_reduce(comm, buf, *c, n);
      EXPECT_TRUE(at::allclose(buf, expected, 1e-6, 1e-7)) << "n " << n;
      expect_same_on_all_ranks(comm, buf);
    }
  });
}

// Many equal magnitudes (x = i mod 7 - 3): top-k takes every entry above
// the k-th magnitude and the ties at it from the lowest indices, exactly k.
TEST_P(Worlds, TopKBreaksTiesByLowestIndex) {
  const int p = GetParam();
  run_ranks(p, [&](Communicator& comm) {
    CompressionOptions o;
    o.kind = CompressionKind::TopK;
    o.topk_ratio = 0.5;
    o.error_feedback = false;
    auto c = make_compressor(o);
    constexpr int64_t kN = 7000, kK = 3500;  // 2000 of magnitude 3, then 1500 of 2
    auto x = at::arange(kN, at::kLong).remainder(7).sub(3).to(at::kFloat);
    auto expected = at::zeros({kN}, at::kFloat);
    int64_t twos = 0;
    for (int64_t i = 0; i < kN; ++i) {
      const float v = x[i].item<float>();
      if (std::abs(v) == 3 || (std::abs(v) == 2 && twos++ < kK - 2000)) expected[i] = v;
    }
    auto buf = x.clone();
    compressed_all_reduce(comm, buf, *c, 0);
    EXPECT_TRUE(at::equal(buf, expected));
  });
}

INSTANTIATE_TEST_SUITE_P(Compression, Worlds, ::testing::Values(1, 2, 3, 4));

// Over many steps, the sum of what was applied equals the sum of the true
// averages minus what the error buffers still hold: nothing is lost, and
// the residual stays at the size of one step's quantization. PowerSGD's
// error is the whole input's (input - output, as PyTorch's hook keeps it),
// so there the sum holds to float rounding alone.
TEST(ErrorFeedback, AppliedSumTracksTrueSum) {
  constexpr int kWorld = 3, kSteps = 40;
  constexpr int64_t kN = 300;
  for (auto kind : {CompressionKind::Int8, CompressionKind::TopK, CompressionKind::PowerSGD}) {
    run_ranks(kWorld, [&](Communicator& comm) {
      at::set_num_threads(1);
      CompressionOptions o;
      o.kind = kind;
      o.int8_chunk = 64;
      o.topk_ratio = 0.05;
      o.powersgd_rank = 1;
      o.powersgd_start_iteration = 2;
      auto c = make_compressor(o);
      auto applied = at::zeros({kN}, at::kDouble), truth = at::zeros({kN}, at::kDouble);
      for (int64_t t = 0; t < kSteps; ++t) {
        for (int r = 0; r < kWorld; ++r) truth += input(r, kN, t).to(at::kDouble) / kWorld;
        auto g = input(comm.rank(), kN, t);
        // A matrix: PowerSGD passes vectors uncompressed.
        if (kind == CompressionKind::PowerSGD) g = g.view({20, 15});
        compressed_all_reduce(comm, g, *c);
        applied += g.view(-1).to(at::kDouble);
      }
      // The average of every rank's worker error (and the owners' errors)
      // is what has not been applied yet.
      auto held = at::zeros({kN}, at::kFloat);
      for (auto& [name, e] : c->state()) {
        if (name.find("error") == std::string::npos || name.find("owner") != std::string::npos)
          continue;
        held += e;
      }
      auto all = at::empty({kWorld * kN}, at::kFloat);
      comm.all_gather_into_tensor(all, held).wait();
      auto pending = all.view({kWorld, kN}).sum(0).to(at::kDouble) / kWorld;
      const double residual = (applied - truth).abs().max().item<double>();
      if (kind == CompressionKind::TopK) {
        EXPECT_TRUE(at::allclose(applied + pending, truth, 1e-5, 1e-4));
        EXPECT_LT(residual, 30.0);  // bounded: each entry is sent within ~1/ratio steps
      } else if (kind == CompressionKind::PowerSGD) {
        // Rank 1 of a 20 x 15 matrix drops most of each step: without the
        // error fed back the sums part by whole inputs (|g| ~ 1 a step).
        const double lost = (applied + pending - truth).abs().max().item<double>();
        EXPECT_LT(lost, 1e-4) << "residual " << residual;
      } else {
        // Worker and owner errors are each below half a scale (|g| < 6 here).
        EXPECT_LT(residual, 2 * 6.0 / 127);
      }
    });
  }
}

// PowerSGD of rank 2 reproduces an average that is exactly rank 2 (shared
// column space, rank-dependent rows) in one step, batches same-shape
// matrices, and passes vectors uncompressed.
TEST(PowerSGD, RecoversExactlyLowRankAverage) {
  for (int p : {1, 3}) {
    run_ranks(p, [&](Communicator& comm) {
      at::set_num_threads(1);
      CompressionOptions o;
      o.kind = CompressionKind::PowerSGD;
      o.powersgd_rank = 2;
      o.powersgd_start_iteration = 0;  // one step: no state to carry
      o.error_feedback = false;
      o.powersgd_warm_start = false;
      auto c = make_compressor(o);
      auto u = input(99, 40 * 2).view({40, 2});
      auto flat = at::empty({2 * 40 * 30 + 7}, at::kFloat);
      std::vector<at::Tensor> shaped = {flat.narrow(0, 0, 1200).view({40, 30}),
                                        flat.narrow(0, 1200, 1200).view({40, 30}),
                                        flat.narrow(0, 2400, 7)};
      std::vector<at::Tensor> expected(3);
      for (int r = 0; r < p; ++r) {
        for (int i = 0; i < 2; ++i) {
          auto m = at::mm(u, input(r, 60, i + 1).view({30, 2}).t()) / p;
          expected[i] = r == 0 ? m : expected[i] + m;
        }
        expected[2] = r == 0 ? input(r, 7) / p : expected[2] + input(r, 7) / p;
      }
      for (int i = 0; i < 2; ++i) {
        shaped[i].copy_(at::mm(u, input(comm.rank(), 60, i + 1).view({30, 2}).t()));
      }
      shaped[2].copy_(input(comm.rank(), 7));
      c->all_reduce(comm, flat, 0, shaped);
      for (int i = 0; i < 3; ++i) {
        EXPECT_TRUE(at::allclose(shaped[i], expected[i], 1e-4, 1e-5)) << "tensor " << i;
      }
      expect_same_on_all_ranks(comm, flat);
    });
  }
}

// A compressor restored from state() at step 4 continues bitwise as the
// uninterrupted one.
TEST(CompressorState, ResumeIsBitwiseTheUninterruptedRun) {
  for (auto kind : {CompressionKind::Int8, CompressionKind::TopK, CompressionKind::PowerSGD}) {
    run_ranks(2, [&](Communicator& comm) {
      at::set_num_threads(1);
      CompressionOptions o;
      o.kind = kind;
      o.powersgd_start_iteration = 2;
      o.powersgd_rank = 2;
      auto step = [&](Compressor& c, int64_t t) {
        auto g = input(comm.rank(), 24 * 10, t).view({24, 10});
        compressed_all_reduce(comm, g, c);
        return g;
      };
      auto straight = make_compressor(o);
      std::vector<at::Tensor> outputs;
      std::map<std::string, at::Tensor> saved;
      for (int64_t t = 0; t < 8; ++t) {
        if (t == 4) saved = straight->state();
        outputs.push_back(step(*straight, t));
      }
      ASSERT_FALSE(saved.empty()) << to_string(kind);
      auto resumed = make_compressor(o);
      resumed->load_state(saved);
      for (int64_t t = 4; t < 8; ++t) {
        EXPECT_TRUE(at::equal(step(*resumed, t), outputs[t])) << to_string(kind) << " step " << t;
      }
    });
  }
}

TEST(Compression, BadInputIsRefused) {
  EXPECT_THROW(parse_compression_kind("gzip"), InvalidArgument);
  CompressionOptions o;
  o.kind = CompressionKind::TopK;
  o.topk_ratio = 0;
  EXPECT_THROW(make_compressor(o), InvalidArgument);
  run_ranks(1, [&](Communicator& comm) {
    auto d = at::zeros({4}, at::kDouble);
    EXPECT_THROW(low_precision_all_reduce(comm, d, at::kHalf), InvalidArgument);
    auto c = make_compressor({});
    EXPECT_THROW(compressed_all_reduce(comm, d, *c), InvalidArgument);
  });
}

}  // namespace
}  // namespace cohort::testing::compression_test
