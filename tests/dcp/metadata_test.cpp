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

TEST(Metadata, JsonRoundTrip) {
  dcp::Metadata meta;
  meta.files = {{"__0_0.distcp", 40}, {"__1_0.distcp", 8}};
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
  EXPECT_EQ(back.files[1].bytes, 8);
  EXPECT_EQ(back.find("model.x"), nullptr);
}

}  // namespace
}  // namespace cohort::testing::metadata_test
