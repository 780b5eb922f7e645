// The box arithmetic under resharding: a flat range of a tensor becomes
// boxes that cover it exactly, in order, each contiguous; the metadata
// survives its JSON round trip.
#include "cohort/dcp/metadata.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace cohort::testing::metadata_test {
namespace {

using dcp::Box;

// Marks the elements of `boxes` in a tensor of `shape` numbered 0..n-1 in
// row-major order and returns the flat indices they hold, in box order.
std::vector<int64_t> flat_indices(const std::vector<int64_t>& shape,
                                  const std::vector<Box>& boxes) {
  const auto numbers = torch::arange(dcp::whole(shape).numel(), torch::kLong).view(shape);
  std::vector<int64_t> out;
  for (const auto& b : boxes) {
    auto t = numbers;
    for (size_t d = 0; d < b.offsets.size(); ++d) {
      t = t.narrow(static_cast<int64_t>(d), b.offsets[d], b.lengths[d]);
    }
    auto flat = t.contiguous().view(-1);
    for (int64_t i = 0; i < flat.numel(); ++i) out.push_back(flat[i].item<int64_t>());
  }
  return out;
}

TEST(Boxes, FlatRangesBecomeBoxesThatCoverThemInOrder) {
  const std::vector<std::vector<int64_t>> shapes = {{},     {1},       {7},         {0, 3},
                                                    {4, 5}, {3, 4, 5}, {2, 1, 3, 2}};
  for (const auto& shape : shapes) {
    const int64_t n = dcp::whole(shape).numel();
    for (int64_t begin = 0; begin <= n; ++begin) {
      for (int64_t end = begin; end <= n; ++end) {
        const auto boxes = dcp::boxes_of_range(shape, begin, end);
        std::vector<int64_t> want;
        for (int64_t i = begin; i < end; ++i) want.push_back(i);
        ASSERT_EQ(flat_indices(shape, boxes), want) << "range " << begin << ":" << end;
        ASSERT_LE(boxes.size(), std::max<size_t>(1, 2 * shape.size()));
      }
    }
  }
}

TEST(Boxes, IntersectionOfDisjointBoxesIsEmpty) {
  const Box a{{0, 0}, {2, 5}}, b{{2, 0}, {3, 5}}, c{{1, 2}, {3, 2}};
  EXPECT_EQ(dcp::intersect(a, b).numel(), 0);
  EXPECT_EQ(dcp::intersect(a, c), (Box{{1, 2}, {1, 2}}));
  EXPECT_EQ(dcp::intersect(b, c), (Box{{2, 2}, {2, 2}}));
}

dcp::TensorMeta tensor_of(std::vector<int64_t> shape, const std::vector<Box>& boxes) {
  dcp::TensorMeta t{"model.w", std::move(shape), torch::kFloat, {}};
  for (const auto& b : boxes) t.chunks.push_back({b, 0, 0, {}});
  return t;
}

// The layouts saving produces tile their tensor exactly: flat ranges cut
// anywhere (ZeRO), column blocks (TP), dim-0 rows (FSDP), a 0-d tensor, an
// empty one; anything else names what is wrong.
TEST(Tiling, ExactTilingsPassAndEveryFaultIsNamed) {
  const std::vector<int64_t> shape = {3, 4, 5};
  for (int64_t cut1 = 0; cut1 <= 60; cut1 += 7) {
    for (int64_t cut2 = cut1; cut2 <= 60; cut2 += 11) {
      std::vector<Box> boxes;
      for (auto [b, e] : {std::pair{int64_t{0}, cut1}, {cut1, cut2}, {cut2, int64_t{60}}}) {
        for (const auto& box : dcp::boxes_of_range(shape, b, e)) boxes.push_back(box);
      }
      EXPECT_EQ(dcp::tiling_error(tensor_of(shape, boxes)), "") << cut1 << " " << cut2;
    }
  }
  EXPECT_EQ(dcp::tiling_error(tensor_of({6, 4}, {{{0, 2}, {6, 2}}, {{0, 0}, {6, 2}}})), "");
  EXPECT_EQ(dcp::tiling_error(tensor_of({7, 5}, {{{0, 0}, {4, 5}}, {{4, 0}, {3, 5}}})), "");
  EXPECT_EQ(dcp::tiling_error(tensor_of({}, {Box{}})), "");
  EXPECT_EQ(dcp::tiling_error(tensor_of({0, 4}, {})), "");

  struct Bad {
    std::vector<int64_t> shape;
    std::vector<Box> boxes;
    std::string expect;
  };
  const std::vector<Bad> cases = {
      // Rows 1..5 and 4..7 of a 7-row tensor: row 4 twice, row 0 in none; the
      // element count alone would pass.
      {{7, 5},
       {{{4, 0}, {3, 5}}, {{1, 0}, {4, 5}}},
       "the chunks [1:5, 0:5] and [4:7, 0:5] overlap"},
      // Two column blocks sharing column 1; rows in every chunk.
      {{6, 4}, {{{0, 0}, {6, 2}}, {{0, 1}, {6, 2}}, {{0, 3}, {6, 1}}}, "overlap"},
      // An overlap between chunks that are not neighbours in row order.
      {{8, 2}, {{{0, 0}, {8, 1}}, {{0, 1}, {4, 1}}, {{2, 0}, {1, 1}}, {{4, 1}, {4, 1}}}, "overlap"},
      {{7, 5}, {{{0, 0}, {4, 5}}}, "its chunks hold 20 of its 35 elements"},
      {{7, 5}, {{{4, 0}, {4, 5}}, {{0, 0}, {4, 5}}}, "the chunk [4:8, 0:5] lies outside"},
      {{7, 5}, {{{-1, 0}, {1, 5}}, {{0, 0}, {7, 5}}}, "lies outside"},
      {{7, 5}, {{{0, 0}, {-2, 5}}, {{0, 0}, {7, 5}}}, "lies outside"},
      {{}, {Box{}, Box{}}, "overlap"},
      {{7, 5}, {{{0}, {7}}}, "another number of dimensions"},
  };
  for (const auto& c : cases) {
    EXPECT_NE(dcp::tiling_error(tensor_of(c.shape, c.boxes)).find(c.expect), std::string::npos)
        << dcp::tiling_error(tensor_of(c.shape, c.boxes));
  }
}

TEST(Metadata, JsonRoundTrip) {
  dcp::Metadata meta;
  meta.files = {{"__0_0.distcp", 40}, {"__1_0.distcp", 64}};
  meta.tensors.push_back({"model.w", {3, 4}, torch::kDouble, {}});
  meta.tensors[0].chunks.push_back({Box{{0, 0}, {1, 4}}, 0, 0, {0xdeadbeef}});
  meta.tensors[0].chunks.push_back({Box{{1, 0}, {2, 4}}, 1, 0, {7}});
  meta.tensors.push_back({"optim.w.step", {}, torch::kLong, {{Box{}, 0, 32, {1}}}});
  const auto back = dcp::metadata_from_json(dcp::metadata_to_json(meta), "test");
  ASSERT_EQ(back.tensors.size(), 2u);
  EXPECT_EQ(back.find("model.w")->dtype, torch::kDouble);
  EXPECT_EQ(back.find("model.w")->chunks[1].box, (Box{{1, 0}, {2, 4}}));
  EXPECT_EQ(back.find("model.w")->chunks[0].crc32[0], 0xdeadbeefu);
  EXPECT_EQ(back.find("optim.w.step")->chunks[0].byte_offset, 32);
  EXPECT_EQ(back.files[1].bytes, 64);
  EXPECT_EQ(back.find("model.x"), nullptr);
}

}  // namespace
}  // namespace cohort::testing::metadata_test
