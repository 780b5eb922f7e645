// defines: test_device(), the device a test that can run on either puts its
// tensors on: the CPU, or what COHORT_TEST_DEVICE names ("cuda" in
// scripts/gpu-check.sh). Expected values are computed on the same device.
#pragma once

#include <torch/types.h>

#include <cstdlib>

namespace cohort::testing {

inline torch::Device test_device() {
  const char* d = std::getenv("COHORT_TEST_DEVICE");
  return torch::Device(d && *d ? d : "cpu");
}

}  // namespace cohort::testing
