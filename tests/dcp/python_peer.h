// defines: run_peer, expect_read_by_python, expect_same,
// python_lacks_safetensors: the C++ side of interchange_peer.py, which
// reads and writes torch.save and safetensors files with Debian's
// python3-torch (and python3-safetensors where installed).
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "cohort/dcp/metadata.h"
#include "cohort/dcp/safetensors.h"
#include "support/subprocess.h"
#include "support/torch_peer.h"

namespace cohort::testing::dcp_test {

inline const std::string kInterchangePeer = std::string(DCP_TEST_DIR) + "/interchange_peer.py";

// Runs interchange_peer.py `args...`; a failure names the command and shows its output.
inline void run_peer(const std::vector<std::string>& args) {
  std::vector<std::string> argv{kTorchPython, kInterchangePeer};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r =
      run_process(argv, Seconds(120), {"PYTHONDONTWRITEBYTECODE=1", "OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.exit_code, 0) << kInterchangePeer << " " << args[0] << ":\n" << r.out << r.err;
}

inline std::string shape_text(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? "," : "") + std::to_string(t.size(d));
  return s + "]";
}

// What the peer read (its manifest and each tensor's bytes) is `want`.
inline void expect_read_by_python(const std::filesystem::path& dir, const dcp::NamedTensors& want) {
  std::ifstream manifest(dir / "manifest.txt");
  std::string name, dtype, shape;
  size_t n = 0;
  while (manifest >> name >> dtype >> shape) {
    ++n;
    const auto* t = want.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(dtype, dcp::dtype_name(t->scalar_type())) << name;
    EXPECT_EQ(shape, shape_text(*t)) << name;
    if (shape != shape_text(*t) || dtype != dcp::dtype_name(t->scalar_type())) continue;
    EXPECT_TRUE(torch::equal(read_raw((dir / (name + ".bin")).string(), t->contiguous()), *t))
        << name;
  }
  EXPECT_EQ(n, want.size());
}

// `got` holds `want`'s names, dtypes and values, to the bit.
inline void expect_same(const dcp::NamedTensors& got, const dcp::NamedTensors& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& item : want) {
    const auto* t = got.find(item.key());
    ASSERT_NE(t, nullptr) << item.key();
    EXPECT_EQ(t->scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_TRUE(torch::equal(*t, item.value())) << item.key();
  }
}

// The reason this Python cannot run the safetensors cases, or nothing
// (probed once: a Python start imports torch, a second).
inline std::optional<std::string> python_lacks_safetensors() {
  static const auto r =
      run_process({kTorchPython, kInterchangePeer, "--probe-safetensors"}, Seconds(60));
  if (r.exit_code == 77) return r.out;
  if (r.exit_code != 0) {
    ADD_FAILURE() << kInterchangePeer << " --probe-safetensors exited " << r.exit_code << ":\n"
                  << r.out << r.err;
    return "the probe failed";
  }
  return std::nullopt;
}

}  // namespace cohort::testing::dcp_test
