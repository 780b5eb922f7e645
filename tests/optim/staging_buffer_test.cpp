// StagingBuffer: one mapping reused from use to use (the pages are only
// lazily given back), and never freed under a tensor that still uses it.
#include "cohort/optim/staging_buffer.h"

#include <gtest/gtest.h>
#include <sys/mman.h>  // MADV_FREE, where the buffer reuses its pages
#include <torch/torch.h>

namespace cohort::staging_buffer_test {
namespace {

TEST(StagingBuffer, ReusesItsMemoryBetweenUses) {
  StagingBuffer buffer(1000, torch::kFloat32);
  EXPECT_EQ(buffer.nbytes(), 4000);
  EXPECT_FALSE(buffer.in_use());
  auto t = buffer.acquire();
  ASSERT_EQ(t.numel(), 1000);
  EXPECT_TRUE(buffer.in_use());
  t.fill_(3);
  EXPECT_TRUE(buffer.acquire().is_same(t));  // one use at a time
  const void* first = t.data_ptr();
  t = torch::Tensor();
  buffer.release();
  EXPECT_FALSE(buffer.in_use());
  auto u = buffer.acquire();
#ifdef MADV_FREE
  EXPECT_EQ(u.data_ptr(), first);  // the same pages, no new allocation
#endif
  u.fill_(5);  // writable again whatever the kernel did with the pages
  EXPECT_EQ(u.sum().item<float>(), 5000);
  buffer.release();
}

TEST(StagingBuffer, KeepsMemoryMappedForTensorsThatOutliveIt) {
  torch::Tensor kept;
  {
    StagingBuffer buffer(256, torch::kFloat32);
    auto t = buffer.acquire();
    t.fill_(-1);
    kept = t.narrow(0, 10, 5);  // e.g. a .grad view the caller kept
    t = torch::Tensor();
    buffer.release();  // contents undefined from here, but still mapped
  }                    // the buffer is gone; `kept` still holds its mapping
  // Lazily freed pages read back as their old contents or as zeros.
  EXPECT_TRUE(((kept == -1) | (kept == 0)).all().item<bool>());
}

}  // namespace
}  // namespace cohort::staging_buffer_test
