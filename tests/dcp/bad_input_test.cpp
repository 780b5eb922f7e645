// Bad checkpoints: metadata from another model, a missing data file, a
// truncated one, a flipped byte, corrupt metadata, a model with another
// name or shape. Each is an error on every rank naming the file or the
// tensor, and nothing is loaded: the model and optimizer keep their values.
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt_files.h"
#include "cohort/dcp/checkpoint_file.h"
#include "cohort/fsdp/fully_shard.h"
#include "support/rank_errors.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::bad_input_test {
namespace {

namespace fs = std::filesystem;

struct OtherImpl : torch::nn::Module {
  OtherImpl() { register_module("a", torch::nn::Linear(5, 8)); }
};
TORCH_MODULE(Other);

struct RenamedImpl : torch::nn::Module {
  RenamedImpl() {
    register_module("a", torch::nn::Linear(5, 7));
    register_module("bb", torch::nn::Linear(7, 3));
    register_module("c", torch::nn::Linear(3, 1));
    register_buffer("scale", torch::zeros({3}));
  }
};
TORCH_MODULE(Renamed);

// A checkpoint of Net (trained, with optimizer state) saved at world 2.
fs::path saved(const std::string& name) {
  const auto dir = temp_dir(name);
  run_ranks(2, [&](Communicator& comm) {
    Net net(1, false);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    train(net, 2, [&] { opt.step(); });
    dcp::save(dcp::get_state_dict(*net, opt), dir, comm);
  });
  return dir;
}

// Loads `dir` at world 3 into a Net that has stepped once; every rank's
// error message; checks that nothing changed.
std::vector<std::string> load_errors(const fs::path& dir) {
  return errors_on_every_rank(3, [&](std::shared_ptr<Communicator> comm) {
    Net net(2, false);
    torch::optim::AdamW opt(net->parameters(), kAdamW);
    train(net, 1, [&] { opt.step(); });
    const auto before = snapshot(*net, &opt);
    auto sd = dcp::get_state_dict(*net, opt);
    try {
      dcp::load(sd, dir, *comm);
    } catch (...) {
      expect_equal(snapshot(*net, &opt), before, "after a failed load");
      throw;
    }
  });
}

void expect_every_rank(const std::vector<std::string>& errors,
                       const std::vector<std::string>& parts) {
  for (size_t r = 0; r < errors.size(); ++r) {
    for (const auto& p : parts) {
      EXPECT_NE(errors[r].find(p), std::string::npos) << "rank " << r << ": " << errors[r];
    }
  }
}

void flip_byte(const fs::path& file, std::streamoff at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(at);
  f.write(&c, 1);
}

TEST(BadInput, MetadataOfAnotherModelNamesTheTensor) {
  const auto dir = saved("other_model");
  const auto other = temp_dir("other_model_src");
  run_ranks(1, [&](Communicator& comm) {
    Other m;
    dcp::save(dcp::get_state_dict(*m), other, comm);
  });
  fs::copy_file(other / ".metadata", dir / ".metadata", fs::copy_options::overwrite_existing);
  expect_every_rank(load_errors(dir),
                    {"tensor model.a.weight", "shape [8, 5] differs from the model's [7, 5]"});
  fs::remove_all(dir);
  fs::remove_all(other);
}

TEST(BadInput, MissingDataFileNamesTheFile) {
  const auto dir = saved("missing");
  fs::remove(dir / "__1_0.distcp");
  expect_every_rank(load_errors(dir), {"__1_0.distcp", "cannot open"});
  fs::remove_all(dir);
}

TEST(BadInput, TruncatedDataFileNamesTheFile) {
  const auto dir = saved("truncated");
  const auto file = dir / "__0_0.distcp";
  fs::resize_file(file, fs::file_size(file) - 3);
  expect_every_rank(load_errors(dir), {"__0_0.distcp", "truncated"});
  fs::remove_all(dir);
}

TEST(BadInput, FlippedByteNamesTheFileAndTensor) {
  const auto dir = saved("flipped");
  const auto file = dir / "__1_0.distcp";
  flip_byte(file, static_cast<std::streamoff>(fs::file_size(file) / 2));
  expect_every_rank(load_errors(dir), {"__1_0.distcp", "checksum mismatch in tensor"});
  fs::remove_all(dir);
}

TEST(BadInput, CorruptMetadataNamesTheFile) {
  const auto dir = saved("bad_meta");
  flip_byte(dir / ".metadata", 40);
  expect_every_rank(load_errors(dir), {".metadata", "checksum mismatch"});
  fs::remove_all(dir);
}

TEST(BadInput, ModelWithAnotherNameNamesTheTensor) {
  const auto dir = saved("renamed");
  const auto errors = errors_on_every_rank(3, [&](std::shared_ptr<Communicator> comm) {
    Renamed m;
    const auto before = m->named_parameters()["a.weight"].clone();
    auto sd = dcp::get_state_dict(*m);
    try {
      dcp::load(sd, dir, *comm);
    } catch (...) {
      EXPECT_TRUE(torch::equal(m->named_parameters()["a.weight"], before)) << "half-loaded";
      throw;
    }
  });
  expect_every_rank(errors, {"tensor model.bb.weight is not in the checkpoint"});
  fs::remove_all(dir);
}

// Rewrites `dir`'s metadata through `edit` and signs it again, as a bad
// writer or a hand edit would leave it: its checksum verifies.
void edit_metadata(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  const auto path = (dir / ".metadata").string();
  auto j = nlohmann::json::parse(read_checkpoint_file(path));
  edit(j);
  write_checkpoint_file(path, j.dump(1));
}

// Every way of reading `dir` (a load at world 1, 2 and 3 into whole
// tensors, inspect, inspect --verify, consolidate) fails with a
// CheckpointError whose message holds each of `parts`, without LibTorch's
// backtrace.
void expect_refused_everywhere(const fs::path& dir, const std::vector<std::string>& parts) {
  for (int world : {1, 2, 3}) {
    expect_every_rank(errors_on_every_rank(world,
                                           [&](std::shared_ptr<Communicator> comm) {
                                             auto seq = make_seq(3);
                                             auto sd = dcp::get_state_dict(*seq);
                                             dcp::load(sd, dir, *comm);
                                           }),
                      parts);
  }
  for (const auto& what : std::vector<std::function<void()>>{
           [&] { cohort_ckpt::inspect_checkpoint(dir.string(), false); },
           [&] { cohort_ckpt::inspect_checkpoint(dir.string(), true); },
           [&] { cohort_ckpt::consolidate_checkpoint(dir.string(), (dir / "out.pt").string()); }}) {
    try {
      what();
      ADD_FAILURE() << "read without an error";
    } catch (const CheckpointError& e) {
      expect_every_rank({e.what()}, parts);
      EXPECT_EQ(std::string(e.what()).find("Exception raised from"), std::string::npos) << e.what();
    }
  }
}

// make_seq's parameters saved by FSDP at world 2: each weight in two dim-0
// chunks, rows [0, 4) and [4, rows).
fs::path saved_fsdp(const std::string& name) {
  const auto dir = temp_dir(name);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = fully_shard(shard_blocks(make_seq(1), comm), comm);
    dcp::save(dcp::get_state_dict(*model), dir, *comm);
  });
  return dir;
}

// Chunk 0 of a weight moved one row down: as many elements as the tensor
// has, but row 0 in none of them and row 4 in both. Refused at every world
// size and by cohort-ckpt, naming the file, the tensor and the chunks.
TEST(BadInput, ChunksThatOverlapAndLeaveAGapAreRefusedEverywhere) {
  const auto dir = saved_fsdp("overlap");
  std::string fqn;
  edit_metadata(dir, [&](nlohmann::json& j) {
    for (auto& t : j.at("tensors")) {
      if (t.at("chunks").size() != 2 || t.at("fqn") != "model.0.weight") continue;
      fqn = t.at("fqn");
      for (auto& c : t.at("chunks")) {
        if (c.at("offsets")[0] == 0) c.at("offsets")[0] = 1;
      }
    }
  });
  ASSERT_EQ(fqn, "model.0.weight");
  expect_refused_everywhere(
      dir, {".metadata", "tensor model.0.weight", "the chunks [1:5, 0:5] and [4:7, 0:5] overlap"});
  fs::remove_all(dir);
}

// Shapes no checkpoint can hold (a negative extent, bytes past 2^63, more
// elements than the chunks hold) are errors naming the file and the
// tensor, never LibTorch's allocator error.
TEST(BadInput, ImpossibleShapesNameTheFileAndTensor) {
  struct Case {
    std::vector<int64_t> shape;
    const char* expect;
  };
  for (const auto& c : {Case{{-3, 5}, "negative extent in its shape [-3, 5]"},
                        Case{{int64_t{1} << 40, int64_t{1} << 40}, "has more bytes than any file"},
                        Case{{int64_t{1} << 40, 5}, "its chunks hold 35 of its 5497558138880"}}) {
    const auto dir = saved_fsdp("shape");
    edit_metadata(dir, [&](nlohmann::json& j) {
      for (auto& t : j.at("tensors")) {
        if (t.at("fqn") == "model.0.weight") t.at("shape") = c.shape;
      }
    });
    expect_refused_everywhere(dir, {".metadata", "tensor model.0.weight", c.expect});
    fs::remove_all(dir);
  }
}

// A tensor listed twice (find() would take either entry, each tiling it),
// a data file named by a path (a load would read outside the folder: here a
// copy of the real file in a subfolder, which would load silently) or by
// ".." are refused everywhere, naming the tensor or the file.
TEST(BadInput, DuplicateTensorsAndFileNamesThatAreNoPlainNamesAreRefused) {
  {
    const auto dir = saved_fsdp("twice");
    edit_metadata(dir, [&](nlohmann::json& j) {
      for (const auto& t : j.at("tensors")) {
        if (t.at("fqn") == "model.2.bias") {
          j.at("tensors").push_back(t);
          break;
        }
      }
    });
    expect_refused_everywhere(dir, {".metadata", "tensor model.2.bias is listed twice"});
    fs::remove_all(dir);
  }
  for (const std::string name : {"sub/__0_0.distcp", ".."}) {
    const auto dir = saved_fsdp("path");
    fs::create_directories(dir / "sub");
    fs::copy_file(dir / "__0_0.distcp", dir / "sub" / "__0_0.distcp");
    edit_metadata(dir, [&](nlohmann::json& j) { j.at("files")[0].at("name") = name; });
    expect_refused_everywhere(dir, {".metadata", "file '" + name + "' is not a plain file name"});
    fs::remove_all(dir);
  }
}

// A shard whose data has its box's elements but not its shape (a [4, 3]
// tensor under a [3, 4] box) would be written, and read, permuted: save and
// load refuse it on every rank with an InvalidArgument naming the tensor,
// the rank and both shapes, at worlds 1 and 3 (the bad shard on the last
// rank only), and a refused load leaves the data as it was.
dcp::StateDict one_tensor(const torch::Tensor& data) {
  dcp::StateDict sd;
  sd.tensors.push_back({"x", {3, 4}, torch::kFloat, true, {{dcp::whole({3, 4}), data}}});
  return sd;
}

class ShardShapes : public ::testing::TestWithParam<int> {};

TEST_P(ShardShapes, DataShapedOtherwiseThanItsBoxIsRefused) {
  const int world = GetParam();
  const auto dir = temp_dir("shard_shape_" + std::to_string(world));
  const auto values = torch::arange(12, torch::kFloat);
  auto check = [&](const std::vector<std::string>& errors, const std::string& op) {
    const std::string rank = std::to_string(world - 1);
    for (size_t r = 0; r < errors.size(); ++r) {
      for (const auto& part : {op + ": tensor x on rank " + rank, std::string("[4, 3]"),
                               std::string("[3, 4]"), std::string("InvalidArgument")}) {
        EXPECT_NE(errors[r].find(part), std::string::npos) << "rank " << r << ": " << errors[r];
      }
    }
  };
  // The type is part of the message: errors_on_every_rank keeps only what().
  auto typed = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const InvalidArgument& e) {
      throw std::runtime_error(std::string("InvalidArgument: ") + e.what());
    }
  };
  check(errors_on_every_rank(world,
                             [&](std::shared_ptr<Communicator> comm) {
                               const bool bad = comm->rank() == comm->size() - 1;
                               auto data = bad ? values.view({4, 3}) : values.view({3, 4});
                               typed([&] { dcp::save(one_tensor(data), dir.string(), *comm); });
                             }),
        "dcp::save");
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    dcp::save(one_tensor(values.view({3, 4})), dir.string(), *comm);
  });
  check(errors_on_every_rank(world,
                             [&](std::shared_ptr<Communicator> comm) {
                               const bool bad = comm->rank() == comm->size() - 1;
                               auto data = bad ? torch::zeros({4, 3}) : torch::zeros({3, 4});
                               auto sd = one_tensor(data);
                               try {
                                 typed([&] { dcp::load(sd, dir.string(), *comm); });
                               } catch (...) {
                                 EXPECT_TRUE(torch::equal(data, torch::zeros_like(data)));
                                 throw;
                               }
                             }),
        "dcp::load");
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShardShapes, ::testing::Values(1, 3));

}  // namespace
}  // namespace cohort::testing::dcp_test::bad_input_test
