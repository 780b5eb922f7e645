// Every compressor against closed-form averages at the edges the other
// compression tests leave out: worlds 5-7 beside 1 and 3, sizes 0, 1 and
// around the world size, tensors that are slices of a larger buffer (whose
// other elements must stay), and PowerSGD's views of sizes 0 and 1, row
// and column matrices, exactly rank-1 matrices and same-shape matrices at
// unequal distances. The settings are those under which each compressor is
// exact on these inputs (int8 with one scale per element, top-k sending
// everything), so any difference is a wrong result, not a rounding.
#include <gtest/gtest.h>

#include "cohort/compression/compressed_collectives.h"
#include "cohort/compression/compressor.h"
#include "support/engine_worlds.h"

namespace cohort::testing::compression_edges_test {
namespace {

using namespace cohort::compression;

// Rank r's element g: w ((r + g) % w + 1 + g % 5). Divided by w (as fp16
// and bf16 do first) they are small integers, whose partial sums every wire
// dtype holds exactly; the average is w (w + 1) / 2 + w (g % 5).
at::Tensor input(int r, int w, int64_t n) {
  auto g = at::arange(n, at::kLong);
  return ((g + r).remainder(w) + 1 + g.remainder(5)).mul(w).to(at::kFloat);
}
at::Tensor average(int w, int64_t n) {
  return (at::arange(n, at::kLong).remainder(5).mul(w) + w * (w + 1) / 2).to(at::kFloat);
}

std::vector<int64_t> sizes_for(int w) { return {0, 1, w - 1, w + 1, 2 * w + 3, 1001}; }

CompressionOptions exact_options(CompressionKind kind, bool feedback) {
  CompressionOptions o;
  o.kind = kind;
  o.error_feedback = feedback;
  o.int8_chunk = 1;    // one scale per element: every value is 127 * its scale
  o.topk_ratio = 1.0;  // every element sent
  return o;
}

class CompressionEdges : public ::testing::TestWithParam<EngineWorld> {};

// fp16, bf16, int8 and top-k (with and without error feedback), on a slice
// of a larger buffer: the exact average, the buffer's other elements as
// they were. Three steps, so error feedback that kept a wrong residue shows.
TEST_P(CompressionEdges, ExactAverageOnASlice) {
  const auto c = GetParam();
  run_ranks(
      c.world,
      [&](Communicator& comm) {
        const int w = comm.size(), me = comm.rank();
        for (auto kind : {CompressionKind::Fp16, CompressionKind::Bf16, CompressionKind::Int8,
                          CompressionKind::TopK}) {
          for (bool feedback : {false, true}) {
            auto compressor = make_compressor(exact_options(kind, feedback));
            for (int64_t n : sizes_for(w)) {
              for (int step = 0; step < 3; ++step) {
                auto storage = at::full({n + 5}, -7.0f);
                auto t = storage.narrow(0, 3, n);
                t.copy_(input(me, w, n));
                compressed_all_reduce(comm, t, *compressor, n);
                ASSERT_TRUE(at::allclose(t, average(w, n), 1e-5, 1e-5))
                    << to_string(kind) << " feedback " << feedback << " n " << n << " step " << step
                    << ": " << (n < 40 ? t : t.narrow(0, 0, 20));
                ASSERT_TRUE(storage.narrow(0, 0, 3).eq(-7).all().item<bool>());
                ASSERT_TRUE(storage.narrow(0, n + 3, 2).eq(-7).all().item<bool>());
              }
            }
          }
        }
      },
      options_for(c));
}

// PowerSGD on a bucket of views of every awkward shape: empty vectors and
// matrices, one element, a row and a column matrix, a 3-d tensor, and two
// same-shape matrices that are rank 1 on every rank ((r + 1) u vᵀ) with a
// vector between them (unequal distances), as is the 3-d tensor. Vectors and matrices too small
// to compress come back as the exact average; the rank-1 matrices as
// their exact average, (w + 1) / 2 u vᵀ, at ranks 1 and 2.
TEST_P(CompressionEdges, PowerSGDAwkwardViews) {
  const auto c = GetParam();
  run_ranks(
      c.world,
      [&](Communicator& comm) {
        const int w = comm.size(), me = comm.rank();
        const std::vector<std::vector<int64_t>> shapes = {
            {0}, {20, 30}, {1}, {0, 5}, {5, 0}, {1, 1}, {3}, {20, 30}, {1, 40}, {40, 1}, {4, 5, 6}};
        // Whether a view holds (r + 1) u vᵀ: compressed or not, its average
        // is (w + 1) / 2 u vᵀ.
        const std::vector<bool> low_rank = {false, true, false, false, false, false,
                                            false, true, false, false, true};
        auto outer = [](const std::vector<int64_t>& s) {
          const int64_t rows = s[0], cols = c10::multiply_integers(s) / rows;
          auto u = at::arange(rows, at::kFloat).sub(7).div(5).view({rows, 1});
          auto v = at::arange(cols, at::kFloat).remainder(4).sub(1.5).view({1, cols});
          return at::mm(u, v).view(s);
        };
        for (int rank : {1, 2}) {
          CompressionOptions o;
          o.kind = CompressionKind::PowerSGD;
          o.powersgd_rank = rank;
          o.powersgd_start_iteration = 0;
          o.error_feedback = false;
          o.powersgd_warm_start = false;
          auto compressor = make_compressor(o);
          int64_t total = 0;
          for (auto& s : shapes) total += c10::multiply_integers(s);
          auto flat = at::empty({total}, at::kFloat);
          std::vector<at::Tensor> views, expected;
          int64_t at = 0;
          for (size_t i = 0; i < shapes.size(); ++i) {
            const int64_t n = c10::multiply_integers(shapes[i]);
            views.push_back(flat.narrow(0, at, n).view(shapes[i]));
            at += n;
            if (low_rank[i]) {
              views.back().copy_(outer(shapes[i]) * (me + 1));
              expected.push_back(outer(shapes[i]) * ((w + 1) / 2.0f));
            } else {
              views.back().view({-1}).copy_(input(me, w, n));
              expected.push_back(average(w, n).view(shapes[i]));
            }
          }
          compressor->all_reduce(comm, flat, 0, views);
          for (size_t i = 0; i < views.size(); ++i) {
            ASSERT_TRUE(at::allclose(views[i], expected[i], 1e-4, 1e-4))
                << "rank " << rank << " view " << i << ": largest error "
                << (views[i] - expected[i]).abs().max().item<float>() << " where the average's "
                << "largest magnitude is " << expected[i].abs().max().item<float>();
          }
        }
      },
      options_for(c));
}

// PowerSGD given views that cover only part of the flat tensor (a matrix
// and a vector, with elements before, between and after them in no view):
// every element comes back averaged, those in no view uncompressed. Views
// that overlap are refused on every rank, before anything is sent.
TEST_P(CompressionEdges, PowerSGDViewsThatLeaveGapsOrOverlap) {
  const auto c = GetParam();
  run_ranks(
      c.world,
      [&](Communicator& comm) {
        const int w = comm.size(), me = comm.rank();
        CompressionOptions o;
        o.kind = CompressionKind::PowerSGD;
        o.powersgd_rank = 1;
        o.powersgd_start_iteration = 0;
        o.error_feedback = false;
        o.powersgd_warm_start = false;
        auto compressor = make_compressor(o);
        // [0, 3) gap, [3, 603) a 20 x 30 matrix, [603, 608) gap, [608, 615)
        // a vector, [615, 619) gap.
        auto flat = input(me, w, 619);
        auto expected = average(w, 619);
        auto u = at::arange(20, at::kFloat).sub(7).div(5).view({20, 1});
        auto v = at::arange(30, at::kFloat).remainder(4).sub(1.5).view({1, 30});
        auto matrix = flat.narrow(0, 3, 600).view({20, 30});
        matrix.copy_(at::mm(u, v) * (me + 1));
        expected.narrow(0, 3, 600).copy_(at::mm(u, v).view({-1}) * ((w + 1) / 2.0f));
        std::vector<at::Tensor> views = {matrix, flat.narrow(0, 608, 7)};
        compressor->all_reduce(comm, flat, 0, views);
        ASSERT_TRUE(at::allclose(flat, expected, 1e-4, 1e-4))
            << "largest error " << (flat - expected).abs().max().item<float>() << " at "
            << (flat - expected).abs().argmax().item<int64_t>();
        auto again = input(me, w, 619);
        std::vector<at::Tensor> overlapping = {again.narrow(0, 0, 600).view({20, 30}),
                                               again.narrow(0, 590, 29)};
        EXPECT_THROW(compressor->all_reduce(comm, again, 1, overlapping), InvalidArgument);
      },
      options_for(c));
}

INSTANTIATE_TEST_SUITE_P(Compression, CompressionEdges,
                         ::testing::ValuesIn(engine_worlds({1, 3, 5, 6, 7})), engine_world_name);

}  // namespace
}  // namespace cohort::testing::compression_edges_test
