// dcp's torch.save and safetensors files against the real readers and
// writers (interchange_peer.py): Python's torch.load (weights_only=True)
// and torch.save through Debian's python3-torch in both lanes, Hugging
// Face's safetensors where python3-safetensors is installed (Debian 13; the
// SafetensorsPython cases skip elsewhere). Equal to the bit: names, dtypes,
// shapes and bytes.
#include <fstream>

#include "cohort/dcp/safetensors.h"
#include "cohort/dcp/torch_file.h"
#include "support/subprocess.h"
#include "support/torch_peer.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::python_interchange_test {
namespace {

namespace fs = std::filesystem;

const std::string kPeer = std::string(DCP_TEST_DIR) + "/interchange_peer.py";

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

void run_peer(const std::vector<std::string>& args) {
  std::vector<std::string> argv{kTorchPython, kPeer};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r =
      run_process(argv, Seconds(120), {"PYTHONDONTWRITEBYTECODE=1", "OMP_NUM_THREADS=1"});
  ASSERT_EQ(r.exit_code, 0) << kPeer << " " << args[0] << ":\n" << r.out << r.err;
}

std::string shape_text(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? "," : "") + std::to_string(t.size(d));
  return s + "]";
}

// What the peer read (its manifest and each tensor's bytes) is `want`.
void expect_read_by_python(const fs::path& dir, const dcp::NamedTensors& want) {
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

void expect_same(const dcp::NamedTensors& got, const dcp::NamedTensors& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& item : want) {
    const auto* t = got.find(item.key());
    ASSERT_NE(t, nullptr) << item.key();
    EXPECT_EQ(t->scalar_type(), item.value().scalar_type()) << item.key();
    EXPECT_TRUE(torch::equal(*t, item.value())) << item.key();
  }
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
  // Probed once (a Python start imports torch: a second).
  static const ProcessResult& probe() {
    static const auto r = run_process({kTorchPython, kPeer, "--probe-safetensors"}, Seconds(60));
    return r;
  }
  void SetUp() override {
    if (probe().exit_code == 77) GTEST_SKIP() << probe().out;
    ASSERT_EQ(probe().exit_code, 0) << probe().out << probe().err;
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
