// safetensors written and read against bytes computed by hand, its
// malformed inputs (each a CheckpointError naming the file and tensor),
// boxes read by seeking, sharded files with an index, and load_weights into
// a bare model and into FSDP ranks (world 1 and 3) from such a file.
#include <fstream>
#include <mutex>
#include <set>

#include "cohort/dcp/safetensors.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/dcp/weights_file.h"
#include "support/thread_ranks.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::interchange_test {
namespace {

namespace fs = std::filesystem;

// The file of a header text and data bytes: the 8-byte little-endian length
// first, as the format says.
std::string file_bytes(const std::string& header, const std::string& data,
                       uint64_t length_field = UINT64_MAX) {
  const uint64_t n = length_field == UINT64_MAX ? header.size() : length_field;
  std::string out(reinterpret_cast<const char*>(&n), 8);
  return out + header + data;
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// {"a": float32 [1, -2], "b": int16 7 (0-d)}: 1.0f is 00 00 80 3f, -2.0f
// 00 00 00 c0; the header padded with spaces to a multiple of 8 bytes.
const char* kHeader = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"I16","shape":[],"data_offsets":[8,10]}})";
const std::string kData("\x00\x00\x80\x3f\x00\x00\x00\xc0\x07\x00", 10);

TEST(Safetensors, WritesAndReadsTheBytesOfTheFormat) {
  const auto dir = temp_dir("st_bytes");
  dcp::NamedTensors t;
  t.insert("a", torch::tensor({1.0f, -2.0f}));
  t.insert("b", torch::tensor(int16_t{7}));
  dcp::save_safetensors(t, (dir / "w.safetensors").string());
  std::string header = kHeader;
  header.append((8 - header.size() % 8) % 8, ' ');
  EXPECT_EQ(read_bytes(dir / "w.safetensors"), file_bytes(header, kData));

  write_bytes(dir / "hand.safetensors", file_bytes(kHeader, kData));
  const auto got = dcp::load_safetensors((dir / "hand.safetensors").string());
  ASSERT_EQ(got.keys(), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(torch::equal(got["a"], torch::tensor({1.0f, -2.0f})));
  EXPECT_EQ(got["b"].scalar_type(), torch::kShort);
  EXPECT_EQ(got["b"].dim(), 0);
  EXPECT_EQ(got["b"].item<int16_t>(), 7);
  fs::remove_all(dir);
}

struct Malformed {
  std::string name, bytes, expect;
};

// The case's name in gtest's messages, not its bytes.
void PrintTo(const Malformed& m, std::ostream* os) { *os << m.name; }

class SafetensorsMalformed : public ::testing::TestWithParam<Malformed> {};

TEST_P(SafetensorsMalformed, IsAClearErrorNamingTheFileAndTensor) {
  const auto dir = temp_dir("st_bad_" + GetParam().name);
  const auto path = (dir / "bad.safetensors").string();
  write_bytes(path, GetParam().bytes);
  try {
    dcp::SafetensorsFile file(path);
    ADD_FAILURE() << "read " << GetParam().name;
  } catch (const CheckpointError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path), std::string::npos) << what;
    EXPECT_NE(what.find(GetParam().expect), std::string::npos) << what;
  }
  fs::remove_all(dir);
}

std::string one(const std::string& entry, const std::string& data = std::string(8, '\0')) {
  return file_bytes("{" + entry + "}", data);
}

INSTANTIATE_TEST_SUITE_P(
    Files, SafetensorsMalformed,
    ::testing::Values(
        Malformed{"truncated", "\x10\x00\x00", "truncated"},
        Malformed{"length_past_eof", file_bytes(kHeader, kData, 1 << 20), "header length 1048576"},
        Malformed{"length_huge", file_bytes(kHeader, kData, uint64_t{1} << 62), "header length"},
        Malformed{"not_json", file_bytes("{\"a\": [", ""), "not JSON"},
        Malformed{"overlap",
                  one(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]})"),
                  "tensors a and b overlap"},
        Malformed{"unknown_dtype",
                  one(R"("a":{"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]})"),
                  "tensor a: unsupported dtype \"F8_E4M3\""},
        Malformed{"negative_shape", one(R"("a":{"dtype":"U8","shape":[-8],"data_offsets":[0,8]})"),
                  "tensor a: the shape [-8] is impossible"},
        Malformed{
            "huge_shape",
            one(R"("a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})"),
            "tensor a: the shape [4294967296, 4294967296] is impossible"},
        Malformed{"past_data", one(R"("a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]})"),
                  "tensor a: data_offsets [0,16] pass the data's 8 bytes"},
        Malformed{"size_mismatch", one(R"("a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]})"),
                  "tensor a: data_offsets [0,8] hold 8 bytes; F32 [3] needs 12"},
        Malformed{"no_offsets", one(R"("a":{"dtype":"F32","shape":[2]})"),
                  "tensor a: needs \"dtype\""}),
    [](const auto& info) { return info.param.name; });

// A box of a [4, 3, 5] tensor is read by seeking: rows (dim 0, one pread),
// a slice of dim 1 or 2 (one pread per run), a single element, no element.
TEST(Safetensors, ReadsBoxesOfATensor) {
  const auto dir = temp_dir("st_box");
  const auto path = (dir / "t.safetensors").string();
  const auto full = torch::arange(60, torch::kDouble).reshape({4, 3, 5}) * 1.5;
  dcp::NamedTensors t;
  t.insert("x", full);
  t.insert("s", torch::tensor(3.0));
  dcp::save_safetensors(t, path);
  const dcp::SafetensorsFile file(path);
  for (const dcp::Box& box : {dcp::Box{{1, 0, 0}, {2, 3, 5}}, dcp::Box{{0, 1, 0}, {4, 2, 5}},
                              dcp::Box{{1, 1, 2}, {3, 2, 3}}, dcp::Box{{3, 2, 4}, {1, 1, 1}},
                              dcp::Box{{2, 0, 0}, {0, 3, 5}}, dcp::whole({4, 3, 5})}) {
    auto want = full;
    for (int d = 0; d < 3; ++d) want = want.narrow(d, box.offsets[d], box.lengths[d]);
    EXPECT_TRUE(torch::equal(file.read_box("x", box), want)) << dcp::to_string(box);
  }
  EXPECT_TRUE(torch::equal(file.read_box("s", dcp::whole({})), torch::tensor(3.0)));
  EXPECT_THROW(file.read_box("x", dcp::Box{{3, 0, 0}, {2, 3, 5}}), CheckpointError);
  EXPECT_THROW(file.read("y"), CheckpointError);
  fs::remove_all(dir);
}

TEST(Safetensors, ShardsAboveTheSizeWithAnIndex) {
  const auto dir = temp_dir("st_shards");
  Net net(3, false);
  dcp::NamedTensors t;
  for (const auto& p : net->named_parameters()) t.insert(p.key(), p.value());
  const auto path = (dir / "model.safetensors").string();
  const auto files = dcp::save_safetensors(t, path, {{{"format", "pt"}}, 120});
  // 35, 7, 21, 3, 3, 1 floats at 30 a shard: 35 alone, 7 + 21, 3 + 3 + 1.
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(fs::path(files[0]).filename(), "model-00001-of-00003.safetensors");
  EXPECT_EQ(files[3], path + ".index.json");
  const dcp::SafetensorsFile index(files[3]);
  EXPECT_EQ(index.find("b.weight")->file, files[1]);
  EXPECT_EQ(index.metadata().at("format"), "pt");
  const auto got = dcp::load_safetensors(files[3]);
  ASSERT_EQ(got.keys(), t.keys());
  for (const auto& item : t) EXPECT_TRUE(torch::equal(got[item.key()], item.value()));
  fs::remove_all(dir);
}

// Saving again under the same path leaves only the new save's files: an
// earlier save's single file beside a sharded save's index (transformers
// reads model.safetensors before an index; load_weights of the path reads
// it), an index and shards beside a single file, or the shards of more
// shards, would give the old weights to whoever reads them.
TEST(Safetensors, SavingAgainLeavesNoFileOfTheEarlierSave) {
  const auto dir = temp_dir("st_again");
  const auto path = (dir / "model.safetensors").string();
  auto tensors_of = [](uint64_t seed) {
    Net net(seed, false);
    dcp::NamedTensors t;
    for (const auto& p : net->named_parameters()) t.insert(p.key(), p.value().detach().clone());
    return t;
  };
  auto files_in_dir = [&] {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().string());
    return out;
  };
  auto expect_only = [&](const std::vector<std::string>& written, const std::string& what) {
    EXPECT_EQ(files_in_dir(), std::set<std::string>(written.begin(), written.end())) << what;
  };
  // One file, then 3 shards (35, 7 + 21, 3 + 3 + 1 floats at 30 a shard).
  expect_only(dcp::save_safetensors(tensors_of(1), path), "one file");
  const auto sharded = tensors_of(2);
  const auto three = dcp::save_safetensors(sharded, path, {{}, 120});
  ASSERT_EQ(three.size(), 4u);
  expect_only(three, "3 shards after one file");
  Net target(5, false);
  dcp::LoadWeightsOptions options;
  options.allow_missing = true;  // the buffer
  try {
    dcp::load_weights(*target, path, options);
    ADD_FAILURE() << "read " << path << " after a sharded save";
  } catch (const CheckpointError&) {
  }
  dcp::load_weights(*target, three.back(), options);
  for (const auto& p : target->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), sharded[p.key()])) << p.key();
  }
  // 2 shards (35 + 7, 21 + 3 + 3 + 1 floats at 50 a shard), then one file again.
  const auto two = dcp::save_safetensors(tensors_of(3), path, {{}, 200});
  ASSERT_EQ(two.size(), 3u);
  expect_only(two, "2 shards after 3");
  expect_only(dcp::save_safetensors(tensors_of(4), path), "one file after shards");
  fs::remove_all(dir);
}

TEST(LoadWeights, BareModelErrorsOnMissingExtraAndShapeAndChangesNothing) {
  const auto dir = temp_dir("weights_bare");
  const auto path = (dir / "w.safetensors").string();
  Net source(1, false), target(2, false);
  dcp::NamedTensors t;
  for (const auto& p : source->named_parameters()) t.insert(p.key(), p.value());
  dcp::save_safetensors(t, path);  // no buffer "scale"
  const auto before = snapshot(*target, nullptr);
  auto expect_error = [&](const std::string& file, const std::string& text) {
    try {
      dcp::load_weights(*target, file);
      ADD_FAILURE() << "loaded " << file;
    } catch (const CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
    expect_equal(snapshot(*target, nullptr), before, file);
  };
  expect_error(path, "the model's tensors scale are not in it");
  t.insert("scale", torch::ones({3}));
  t.insert("extra", torch::ones({1}));
  dcp::save_safetensors(t, path);
  expect_error(path, "its tensors extra are not the model's");
  t["scale"] = torch::ones({4});
  dcp::save_safetensors(t, path);
  expect_error(path, "tensor scale: the file's shape [4] is not the model's [3]");

  t.erase("scale");
  dcp::save_safetensors(t, path);
  dcp::LoadWeightsOptions options;
  options.allow_missing = options.allow_unexpected = true;
  EXPECT_EQ(dcp::load_weights(*target, path, options), 6);
  auto want = snapshot(*source, nullptr);
  want["model.scale"] = before.at("model.scale");
  expect_equal(snapshot(*target, nullptr), want, "allow_missing");
  fs::remove_all(dir);
}

// Each FSDP rank reads its dim-0 rows of every parameter from the file (as
// a box: one pread); the sharded model then gives the source model's outputs.
class LoadWeightsFsdp : public ::testing::TestWithParam<int> {};

TEST_P(LoadWeightsFsdp, EachRankReadsItsRows) {
  const auto dir = temp_dir("weights_fsdp" + std::to_string(GetParam()));
  const auto path = (dir / "w.safetensors").string();
  auto source = make_seq(1);
  dcp::NamedTensors t;
  for (const auto& p : source->named_parameters()) t.insert(p.key(), p.value());
  dcp::save_safetensors(t, path);
  const auto x = batch(7, 9);
  torch::Tensor want;
  {
    torch::NoGradGuard no_grad;
    want = source->forward(x);
  }
  std::mutex mu;
  run_ranks_shared(GetParam(), [&](std::shared_ptr<Communicator> comm) {
    auto model = make_fsdp(2, comm);
    auto sd = dcp::get_state_dict(*model);
    dcp::LoadWeightsOptions options;
    options.comm = comm.get();
    const int filled = dcp::load_weights(sd, path, options);
    torch::NoGradGuard no_grad;
    auto y = model->forward(x);
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_GE(filled, 1);
    EXPECT_TRUE(torch::equal(y, want)) << "rank " << comm->rank();
  });
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Worlds, LoadWeightsFsdp, ::testing::Values(1, 3));

// A tensor only rank 2 holds is not in the file: with options.comm every
// rank throws rank 2's error, and no rank changed a tensor.
TEST(LoadWeights, OneRanksErrorIsEveryRanksAndNothingChanges) {
  const auto dir = temp_dir("weights_agree");
  const auto path = (dir / "w.safetensors").string();
  Net source(1, false);
  dcp::NamedTensors t;
  for (const auto& p : source->named_parameters()) t.insert(p.key(), p.value());
  for (const auto& b : source->named_buffers()) t.insert(b.key(), b.value());
  dcp::save_safetensors(t, path);
  std::mutex mu;
  int errors = 0;
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    Net target(2, false);
    const auto before = snapshot(*target, nullptr);
    auto sd = dcp::get_state_dict(*target);
    auto extra = torch::zeros({2});
    if (comm->rank() == 2)
      sd.tensors.push_back({"model.extra", {2}, torch::kFloat, true, {{dcp::whole({2}), extra}}});
    dcp::LoadWeightsOptions options;
    options.comm = comm.get();
    try {
      dcp::load_weights(sd, path, options);
    } catch (const CheckpointError& e) {
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_NE(std::string(e.what()).find("rank 2: dcp::load_weights: " + path +
                                           ": the model's tensors extra are not in it"),
                std::string::npos)
          << e.what();
      ++errors;
    }
    std::lock_guard<std::mutex> lock(mu);
    expect_equal(snapshot(*target, nullptr), before, "rank " + std::to_string(comm->rank()));
  });
  EXPECT_EQ(errors, 3);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace cohort::testing::dcp_test::interchange_test
