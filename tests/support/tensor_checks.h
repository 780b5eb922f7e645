// defines: the gtest checks that compare a tensor with its reference
// (a one-process run or a closed form), with a message naming what differs.
#pragma once

#include <gtest/gtest.h>
#include <torch/types.h>

#include <algorithm>
#include <string>

namespace cohort::testing {

// Largest difference within `rel` of the reference's largest magnitude: one
// bound for a tensor whatever its scale (float sums in another order differ
// by a few ulps of the largest term).
inline void expect_close(const torch::Tensor& got, const torch::Tensor& want,
                         const std::string& what, double rel = 1e-5) {
  ASSERT_TRUE(got.defined()) << what << ": undefined (no gradient)";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(want.abs().max().item<double>(), 1e-6);
  const double err = (got - want).abs().max().item<double>();
  EXPECT_LE(err, rel * scale) << what << ": max error " << err << " at scale " << scale
                              << " (got sum " << got.sum().item<double>() << ", want sum "
                              << want.sum().item<double>() << ")";
}

// Element by element, as torch::allclose.
inline void expect_allclose(const torch::Tensor& got, const torch::Tensor& want,
                            const std::string& what, double rtol = 1e-5, double atol = 1e-5) {
  ASSERT_TRUE(got.defined()) << what << ": undefined (no gradient)";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(torch::allclose(got, want, rtol, atol))
      << what << ": max |diff| " << (got - want).abs().max().item<double>() << " (got sum "
      << got.sum().item<double>() << ", want sum " << want.sum().item<double>() << ")";
}

}  // namespace cohort::testing
