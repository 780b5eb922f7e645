// dcp's torch.save and safetensors files against the real readers and
// writers (interchange_peer.py): Python's torch.load (weights_only=True)
// and torch.save through Debian's python3-torch in both lanes, Hugging
// Face's safetensors where python3-safetensors is installed (Debian 13; the
// SafetensorsPython cases skip elsewhere). Equal to the bit: names, dtypes,
// shapes and bytes.
#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/safetensors.h"
#include "cohort/dcp/torch_file.h"
#include "tests/dcp/dcp_test_support.h"
#include "tests/dcp/python_peer.h"

namespace cohort::testing::dcp_test::python_interchange_test {
namespace {

namespace fs = std::filesystem;

// The dict interchange_peer.py builds, computed here.
dcp::NamedTensors closed_form(bool contiguous_only) {
  dcp::NamedTensors d;
  d.insert("w", torch::arange(12, torch::kFloat).reshape({3, 4}) / 8 - 0.5);
  d.insert("b", torch::arange(5, torch::kBFloat16) * 0.25);
  d.insert("h", torch::arange(4, torch::kHalf) * 0.5);
  d.insert("d", torch::tensor(2.5, torch::kDouble));
  d.insert("i", torch::arange(-3, 3, torch::kLong) * int64_t{1000000000000});
  d.insert("k", torch::arange(6, torch::kInt).reshape({1, 2, 3}) - 2);
  d.insert("m", torch::tensor({true, false, true}));
  d.insert("e", torch::zeros({0, 3}));
  if (!contiguous_only) d.insert("t", (torch::arange(6, torch::kFloat).reshape({2, 3}) + 1).t());
  return d;
}

// cohort writes the closed-form dict (save_torch for torch-read, else
// save_safetensors) and the peer's `command` reads it.
void expect_python_reads(const std::string& command, bool contiguous_only) {
  const auto dir = temp_dir("py_" + command);
  const auto path = (dir / "w").string();
  const auto want = closed_form(contiguous_only);
  if (command == "torch-read") {
    dcp::save_torch(want, path);
  } else {
    dcp::save_safetensors(want, path);
  }
  run_peer({command, path, (dir / "read").string()});
  expect_read_by_python(dir / "read", want);
  fs::remove_all(dir);
}

TEST(TorchPython, TorchLoadReadsWhatCohortWrote) { expect_python_reads("torch-read", false); }

// The zip format is read, strided views included; the legacy format is a
// clear error.
TEST(TorchPython, CohortReadsWhatTorchSaveWrote) {
  const auto dir = temp_dir("py_torch_save");
  const auto path = (dir / "w.pt").string();
  run_peer({"torch-write", path});
  expect_same(dcp::load_torch(path), closed_form(false));
  try {
    dcp::load_torch(path + ".legacy");
    ADD_FAILURE() << "read the legacy format";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(path + ".legacy: not a zip archive"), std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

class SafetensorsPython : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto reason = python_lacks_safetensors()) GTEST_SKIP() << *reason;
  }
};

TEST_F(SafetensorsPython, SafetensorsReadsWhatCohortWrote) { expect_python_reads("st-read", true); }

TEST_F(SafetensorsPython, CohortReadsWhatSafetensorsWrote) {
  const auto dir = temp_dir("py_st_write");
  const auto path = (dir / "w.safetensors").string();
  run_peer({"st-write", path});
  expect_same(dcp::load_safetensors(path), closed_form(true));
  EXPECT_EQ(dcp::SafetensorsFile(path).metadata().at("by"), "python");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace cohort::testing::dcp_test::python_interchange_test
