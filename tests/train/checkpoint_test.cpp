// Checkpoints: the file format catches truncation and flipped bytes; resume
// continues bitwise identically; a damaged newest checkpoint is reported by
// name and the previous good one is used.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include "cohort/dcp/checkpoint_file.h"
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/trainer_adapters.h"
#include "cohort/train/rng_state.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/train/training_state.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::checkpoint_test {
namespace {

using cohort::testing::TempDir;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void dump(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "(no CheckpointError)";
}

TEST(CheckpointFile, RoundTripsAndDetectsDamage) {
  TempDir dir("cohort-ckfile");
  const std::string path = dir / "a.cohort";
  std::string payload(1000, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 7);
  write_checkpoint_file(path, payload);
  EXPECT_EQ(read_checkpoint_file(path), payload);
  EXPECT_EQ(std::filesystem::file_size(path), kCheckpointHeaderBytes + payload.size());

  const std::string good = slurp(path);
  dump(path, good.substr(0, good.size() - 10));
  auto msg = error_of([&] { read_checkpoint_file(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;

  std::string flipped = good;
  flipped[kCheckpointHeaderBytes + 500] ^= 0x01;
  dump(path, flipped);
  msg = error_of([&] { read_checkpoint_file(path); });
  EXPECT_NE(msg.find("checksum mismatch"), std::string::npos) << msg;

  dump(path, "not a checkpoint at all, but long enough");
  msg = error_of([&] { read_checkpoint_file(path); });
  EXPECT_NE(msg.find("bad magic"), std::string::npos) << msg;

  dump(path, good.substr(0, 5));
  msg = error_of([&] { read_checkpoint_file(path); });
  EXPECT_NE(msg.find("header"), std::string::npos) << msg;
}

// One training job on `world` thread ranks: DDP + AdamW over a shuffled
// TensorDataSource, with checkpoints in `dir`.
struct Job {
  int world = 2;
  std::string dir;
  int64_t max_steps = 10;
  int64_t checkpoint_every = 5;
  int keep_last = 3;
  std::string metrics;
  bool resume = false;
  bool ddp = true;    // DDP's in-backward reduction, else the all-reduce fallback
  bool zero = false;  // ZeRO stage 1 after DDP (sharded optimizer state)
  bool start_fresh_if_damaged = false;
  bool async = false;       // TrainerOptions::async_checkpoint
  bool record_rng = false;  // JobResult::rng_after_resume
};

struct JobResult {
  std::optional<int64_t> resumed_at;
  std::vector<std::optional<int64_t>> resumed_by_rank;
  std::vector<std::string> errors;                          // what resume() threw, by rank
  std::vector<std::string> skipped;                         // rank 0's skipped checkpoints
  std::vector<double> losses;                               // per step run (rank 0)
  std::vector<torch::Tensor> params;                        // rank 0's final parameters
  std::map<int64_t, std::vector<torch::Tensor>> params_at;  // after step s
  std::vector<std::string> fit_errors;                      // what fit() threw, by rank
  torch::Tensor rng_before_resume;  // the CPU generator's state before any rank resumed
  torch::Tensor rng_after_resume;   // ...and once every rank resumed
};

JobResult run_job(const Job& job) {
  const auto data = testing::make_data(96);
  JobResult result;
  result.resumed_by_rank.resize(job.world);
  result.errors.resize(job.world);
  result.fit_errors.resize(job.world);
  testing::run_ranks_shared(job.world, [&](std::shared_ptr<Communicator> comm) {
    // A different init than the checkpoint's: resume must overwrite it.
    auto net = testing::make_mlp(job.resume ? 99 : 7);
    DistributedDataParallel<torch::nn::Sequential> ddp(net, comm);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    std::unique_ptr<ZeroRedundancyOptimizer> zero;
    if (job.zero) {
      ZeroOptions zo;
      zo.reduce_gradients = false;                  // DDP averages them
      zo.bucket_cap_mb = 64.0 * 4 / (1024 * 1024);  // several buckets
      zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
          net->parameters(), comm, torch::optim::AdamWOptions(1e-2), zo);
    }
    // ZeRO here steps DDP's averages (reduce_gradients false), so it goes with DDP only.
    auto wiring = job.zero  ? TrainerWiring::ddp(ddp, *zero)
                  : job.ddp ? TrainerWiring::ddp(ddp, opt)
                            : TrainerWiring::all_reduce(net.ptr(), opt, comm);
    TrainerOptions config;
    config.accumulation_steps = 2;
    config.max_grad_norm = 1.0;
    config.schedule = {LrScheduleKind::WarmupCosine, 1e-2, 3, 12, 1e-4};
    config.epochs = 100;
    config.max_steps = job.max_steps;
    config.checkpoint_dir = job.dir;
    config.checkpoint_every = job.checkpoint_every;
    config.keep_last = job.keep_last;
    config.metrics_path = job.metrics;
    config.progress = false;
    config.start_fresh_if_damaged = job.start_fresh_if_damaged;
    config.async_checkpoint = job.async;
    Trainer trainer(
        std::move(wiring),
        [&](const torch::data::Example<>& b) {
          auto out = job.ddp ? ddp.forward(b.data) : net->forward(b.data);
          return torch::nn::functional::cross_entropy(out, b.target);
        },
        config);
    TensorDataSource source(data.x, data.y, 4, comm->rank(), comm->size());
    std::optional<int64_t> resumed;
    // The ranks are threads of one process, sharing the generator: read
    // once every rank has built its model (which draws from it) and before
    // any resumes, and once all resumed.
    auto record_rng = [&](torch::Tensor& into) {
      comm->barrier().wait();
      if (comm->rank() == 0) into = cpu_rng_state();
      comm->barrier().wait();
    };
    if (job.record_rng) record_rng(result.rng_before_resume);
    try {
      resumed = job.resume ? trainer.resume() : std::nullopt;
    } catch (const Error& e) {  // CheckpointError, or ConfigError for a refused one
      result.errors[comm->rank()] = e.what();
      if (comm->rank() == 0) {
        for (auto& p : net->parameters()) result.params.push_back(p.detach().clone());
      }
      return;
    }
    result.resumed_by_rank[comm->rank()] = resumed;
    if (job.record_rng) record_rng(result.rng_after_resume);
    FitCallbacks callbacks;
    std::vector<double> losses;
    std::map<int64_t, std::vector<torch::Tensor>> params_at;
    callbacks.on_step = [&](const StepMetrics& m) {
      losses.push_back(m.loss);
      std::vector<torch::Tensor> copy;
      for (auto& p : net->parameters()) copy.push_back(p.detach().clone());
      params_at[m.step] = copy;
    };
    try {
      trainer.fit(source, callbacks);
    } catch (const Error& e) {
      result.fit_errors[comm->rank()] = e.what();
      return;
    }
    if (comm->rank() == 0) {
      result.resumed_at = resumed;
      result.skipped = trainer.skipped_checkpoints();
      result.losses = losses;
      for (auto& p : net->parameters()) result.params.push_back(p.detach().clone());
      result.params_at = params_at;
    }
  });
  return result;
}

void expect_equal_params(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

class ResumeTest : public ::testing::TestWithParam<bool> {};

TEST_P(ResumeTest, IsBitwiseIdentical) {
  const bool ddp = GetParam();
  TempDir whole("cohort-whole"), split("cohort-split");
  // 96 samples / 2 ranks / 4 per micro-batch / 2 per step = 6 steps an
  // epoch: the run crosses an epoch boundary and resumes mid-epoch.
  const auto uninterrupted = run_job({2, whole.str(), 10, 5, 3, whole / "m.jsonl", false, ddp});
  ASSERT_EQ(uninterrupted.losses.size(), 10u);

  run_job({2, split.str(), 5, 5, 3, split / "m.jsonl", false, ddp});
  const auto resumed = run_job({2, split.str(), 10, 5, 3, split / "m.jsonl", true, ddp});
  ASSERT_EQ(resumed.resumed_at, std::optional<int64_t>(5));
  ASSERT_EQ(resumed.losses.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(resumed.losses[i], uninterrupted.losses[5 + i]) << "step " << 6 + i;
  }
  expect_equal_params(resumed.params, uninterrupted.params);

  // The resumed metrics file reads as one run: steps 1..10, once each.
  std::ifstream in(split / "m.jsonl");
  std::string line;
  int64_t expect_step = 1;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["kind"], "train");
    EXPECT_EQ(j["step"].get<int64_t>(), expect_step++);
  }
  EXPECT_EQ(expect_step, 11);
}

INSTANTIATE_TEST_SUITE_P(TrainerCheckpoint, ResumeTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return std::string(i.param ? "ddp" : "allreduce");
                         });

// Rank 0's file of an earlier cohort that held the model and optimizer in
// it (the fused optimizer's, or DDP's before it wrote dcp), which has no
// dcp folder: a ConfigError on every rank saying so, rather than a skip as
// damaged, and nothing loaded.
TEST(TrainerCheckpoint, ModelInTheFileOfAnEarlierCohortIsRefusedOnEveryRank) {
  TempDir dir("cohort-earlier");
  torch::serialize::OutputArchive archive, model_archive, optimizer_archive;
  testing::make_mlp(7)->save(model_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", optimizer_archive);
  for (const char* key : {"step", "epoch", "batch"}) archive.write(key, c10::IValue(int64_t{5}));
  archive.write("rng_states", torch::zeros({2, 8}, torch::kUInt8));
  std::ostringstream bytes;
  archive.save_to(bytes);
  CheckpointDir(dir.str(), 3).write(5, bytes.str());
  const auto r = run_job({2, dir.str(), 10, 5, 3, dir / "m.jsonl", true});
  ASSERT_EQ(r.errors.size(), 2u);
  for (int rank = 0; rank < 2; ++rank) {
    const auto& e = r.errors[rank];
    EXPECT_NE(e.find("on rank " + std::to_string(rank)), std::string::npos) << e;
    EXPECT_NE(e.find("written by an earlier cohort that held the model and optimizer in this "
                     "file, which this version no longer reads"),
              std::string::npos)
        << e;
  }
  expect_equal_params(r.params, testing::make_mlp(99)->parameters());
}

// ZeRO's sharded state: a distributed checkpoint next to rank 0's file
// (every rank's data file and the metadata), resume reads it back, and the
// resumed run is bitwise the uninterrupted one; rotated-out checkpoints take
// their folders with them.
TEST(TrainerCheckpoint, ZeroShardsResumeBitwise) {
  TempDir whole("cohort-zero-whole"), split("cohort-zero-split");
  Job job{2, whole.str(), 10, 5, 3, whole / "m.jsonl", false, true, true};
  const auto uninterrupted = run_job(job);
  ASSERT_EQ(uninterrupted.losses.size(), 10u);
  job.dir = split.str();
  job.metrics = split / "m.jsonl";
  job.max_steps = 5;
  run_job(job);
  const std::string folder = CheckpointDir(split.str(), 3).path_for(5) + ".dcp";
  EXPECT_TRUE(std::filesystem::exists(folder + "/.metadata"));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(std::filesystem::exists(folder + "/__" + std::to_string(r) + "_0.distcp"));
  }
  job.max_steps = 10;
  job.resume = true;
  const auto resumed = run_job(job);
  ASSERT_EQ(resumed.resumed_at, std::optional<int64_t>(5));
  ASSERT_EQ(resumed.losses.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(resumed.losses[i], uninterrupted.losses[5 + i]) << "step " << 6 + i;
  }
  expect_equal_params(resumed.params, uninterrupted.params);

  // keep_last 1: only the newest checkpoint and its folder remain.
  TempDir rotate("cohort-zero-rotate");
  run_job({2, rotate.str(), 6, 2, 1, rotate / "m.jsonl", false, true, true});
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(rotate.str())) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"ckpt-0000000006.cohort", "ckpt-0000000006.cohort.dcp",
                                             "m.jsonl"}));
}

TEST(TrainerCheckpoint, DamagedNewestFallsBackToThePreviousOne) {
  TempDir dir("cohort-fallback");
  const auto first = run_job({2, dir.str(), 6, 2, 2, ""});
  CheckpointDir folder(dir.str(), 2);
  ASSERT_EQ(folder.steps(), (std::vector<int64_t>{6, 4}));  // keep_last = 2
  const std::string newest = folder.path_for(6);
  const std::string good = slurp(newest);

  struct Damage {
    std::string name, bytes, expect;
  };
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x40;
  for (const auto& d : {Damage{"truncated", good.substr(0, good.size() / 3), "truncated"},
                        Damage{"flipped", flipped, "checksum mismatch"}}) {
    dump(newest, d.bytes);
    // max_steps 4: resuming at 4 does no further step, so the parameters
    // are exactly those loaded from the step-4 checkpoint.
    const auto r = run_job({2, dir.str(), 4, 2, 2, "", true});
    EXPECT_EQ(r.resumed_at, std::optional<int64_t>(4)) << d.name;
    ASSERT_EQ(r.skipped.size(), 1u) << d.name;
    EXPECT_NE(r.skipped[0].find(newest), std::string::npos) << r.skipped[0];
    EXPECT_NE(r.skipped[0].find(d.expect), std::string::npos) << r.skipped[0];
    expect_equal_params(r.params, first.params_at.at(4));
  }
}

// A ZeRO checkpoint is whole only with its distributed part: a folder
// without .metadata, with a damaged .metadata or with a missing or
// truncated data file is skipped like a damaged file, and resume falls
// back to the previous checkpoint.
TEST(TrainerCheckpoint, DamagedDcpFolderFallsBackToThePreviousOne) {
  struct Damage {
    std::string name, file, expect;
    bool remove;
  };
  for (const auto& d : {Damage{"no metadata", ".metadata", ".metadata", true},
                        Damage{"damaged metadata", ".metadata", "checksum mismatch", false},
                        Damage{"missing data file", "__1_0.distcp", "__1_0.distcp", true},
                        Damage{"truncated data file", "__0_0.distcp", "__0_0.distcp", false}}) {
    TempDir dir("cohort-dcp-fallback");
    const auto first = run_job({2, dir.str(), 6, 2, 2, "", false, true, true});
    CheckpointDir folder(dir.str(), 2);
    ASSERT_EQ(folder.steps(), (std::vector<int64_t>{6, 4}));
    const std::string file = folder.path_for(6) + ".dcp/" + d.file;
    const std::string good = slurp(file);
    if (d.remove) {
      std::filesystem::remove(file);
    } else if (d.file == ".metadata") {
      std::string flipped = good;
      flipped[good.size() / 2] ^= 0x40;
      dump(file, flipped);
    } else {
      dump(file, good.substr(0, good.size() / 2));
    }
    const auto r = run_job({2, dir.str(), 4, 2, 2, "", true, true, true});
    EXPECT_EQ(r.resumed_at, std::optional<int64_t>(4)) << d.name;
    ASSERT_EQ(r.skipped.size(), 1u) << d.name;
    EXPECT_NE(r.skipped[0].find(d.expect), std::string::npos) << d.name << ": " << r.skipped[0];
    expect_equal_params(r.params, first.params_at.at(4));
  }
}

// A flipped byte in a data file of the newest checkpoint's dcp folder, which
// only the rank that reads it meets (the file has the listed size): every
// rank falls back to the previous checkpoint alike, saying which and why.
TEST(TrainerCheckpoint, DamagedDcpDataFallsBackOnEveryRank) {
  for (const int world : {1, 3}) {
    TempDir dir("cohort-dcp-data-fallback");
    const auto first = run_job({world, dir.str(), 6, 2, 2, "", false, true, true});
    CheckpointDir folder(dir.str(), 2);
    ASSERT_EQ(folder.steps(), (std::vector<int64_t>{6, 4}));
    const std::string file =
        folder.path_for(6) + ".dcp/__" + std::to_string(world - 1) + "_0.distcp";
    std::string bytes = slurp(file);
    bytes[bytes.size() / 2] ^= 0x40;
    dump(file, bytes);
    ::testing::internal::CaptureStderr();
    const auto r = run_job({world, dir.str(), 4, 2, 2, "", true, true, true});
    const std::string err = ::testing::internal::GetCapturedStderr();
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_EQ(r.resumed_by_rank[rank], std::optional<int64_t>(4))
          << "rank " << rank << ": " << r.errors[rank];
    }
    ASSERT_EQ(r.skipped.size(), 1u) << err;
    EXPECT_NE(r.skipped[0].find(file), std::string::npos) << r.skipped[0];
    EXPECT_NE(r.skipped[0].find("checksum mismatch"), std::string::npos) << r.skipped[0];
    EXPECT_NE(err.find("cohort: skipping"), std::string::npos) << err;
    EXPECT_NE(err.find("resuming from the previous good checkpoint " + folder.path_for(4)),
              std::string::npos)
        << err;
    expect_equal_params(r.params, first.params_at.at(4));
  }
}

// The only checkpoint's dcp data damaged and start_fresh_if_damaged: the
// job starts from step 0 with nothing of the skipped checkpoint, its
// generators included (they are the ones before resume()), at worlds 1
// and 3.
TEST(TrainerCheckpoint, StartingFreshKeepsTheGeneratorsOfBeforeTheResume) {
  for (const int world : {1, 3}) {
    TempDir dir("cohort-fresh-rng");
    run_job({world, dir.str(), 2, 2, 2, "", false, true, true});
    CheckpointDir folder(dir.str(), 2);
    ASSERT_EQ(folder.steps(), (std::vector<int64_t>{2}));
    const auto saved = decode_training_state(folder.load(2), folder.path_for(2)).rng_states;
    const std::string file =
        folder.path_for(2) + ".dcp/__" + std::to_string(world - 1) + "_0.distcp";
    std::string bytes = slurp(file);
    bytes[bytes.size() / 2] ^= 0x40;
    dump(file, bytes);
    Job job{world, dir.str(), 2, 2, 2, "", true, true, true};
    job.start_fresh_if_damaged = true;
    job.record_rng = true;
    ::testing::internal::CaptureStderr();
    const auto r = run_job(job);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_FALSE(r.resumed_at.has_value()) << err;
    ASSERT_EQ(r.skipped.size(), 1u) << err;
    ASSERT_TRUE(r.rng_after_resume.defined()) << r.errors[0];
    for (int rank = 0; rank < world; ++rank) {
      ASSERT_FALSE(torch::equal(saved[rank], r.rng_before_resume)) << "rank " << rank;
    }
    EXPECT_TRUE(torch::equal(r.rng_after_resume, r.rng_before_resume)) << "world " << world;
  }
}

// Rank 0's file of the last checkpoint cannot be written (a folder stands
// where it goes): fit() throws the same CheckpointError, naming the file,
// on every rank, with a blocking and with an async checkpoint, rather than
// rank 0 alone while the others return as if it were saved.
TEST(TrainerCheckpoint, AFailedWriteOfTheMainFileThrowsOnEveryRank) {
  for (const bool async : {false, true}) {
    TempDir dir("cohort-main-file-fails");
    const auto path = CheckpointDir(dir.str(), 2).path_for(2);
    std::filesystem::create_directories(path + "/x");
    Job job{3, dir.str(), 2, 2, 2, "", false, true, true};
    job.async = async;
    const auto r = run_job(job);
    for (int rank = 0; rank < 3; ++rank) {
      const auto& e = r.fit_errors[rank];
      EXPECT_NE(e.find("rank 0: Trainer checkpoint of step 2: checkpoint " + path),
                std::string::npos)
          << (async ? "async" : "blocking") << ", rank " << rank << ": " << e;
      EXPECT_EQ(e, r.fit_errors[0]) << "rank " << rank;
    }
  }
}

// A rank killed while writing its data file leaves write_file_atomically's
// temporary file in the dcp folder; the resumed job saves that step again
// into the same folder, which must not keep it.
TEST(TrainerCheckpoint, TemporaryFilesOfAKilledWriterAreRemoved) {
  TempDir dir("cohort-dcp-tmp");
  run_job({2, dir.str(), 4, 2, 3, "", false, true, true});
  const std::string folder = CheckpointDir(dir.str(), 3).path_for(6) + ".dcp";
  std::filesystem::create_directories(folder);
  const std::string left = folder + "/__1_0.distcp.tmp.999999.12345";
  dump(left, "half a data file");
  const auto r = run_job({2, dir.str(), 6, 2, 3, "", true, true, true});
  ASSERT_EQ(r.resumed_at, std::optional<int64_t>(4));
  EXPECT_FALSE(std::filesystem::exists(left));
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(folder)) {
    names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{".metadata", "__0_0.distcp", "__1_0.distcp"}));
}

// Damaged checkpoints count for nothing in rotation: the step just written
// and the newest good ones stay, damaged files are left alone.
TEST(CheckpointDir, RotatesOnlyCheckpointsThatVerify) {
  TempDir dir("cohort-rotate");
  {
    CheckpointDir folder(dir.str(), 2);
    folder.write(100, "a");
    folder.write(200, "b");
  }
  for (int64_t step : {100, 200}) {
    const auto path = CheckpointDir(dir.str(), 2).path_for(step);
    dump(path, slurp(path).substr(0, 10));
  }
  CheckpointDir folder(dir.str(), 2);  // a new process: nothing verified yet
  folder.write(50, "c");
  auto loaded = folder.load_latest();
  ASSERT_TRUE(loaded.found) << "the good checkpoint just written was rotated out";
  EXPECT_EQ(loaded.step, 50);
  EXPECT_EQ(loaded.skipped.size(), 2u);
  folder.write(60, "d");
  folder.write(70, "e");
  // keep_last 2 of the good ones (70, 60); 50 rotated out; damaged kept.
  EXPECT_EQ(folder.steps(), (std::vector<int64_t>{200, 100, 70, 60}));
}

TEST(CheckpointDir, StepOutOfRangeInANameIsSkippedWithAMessage) {
  TempDir dir("cohort-stray");
  CheckpointDir folder(dir.str(), 2);
  folder.write(5, "good");
  dump(dir / "ckpt-99999999999999999999.cohort", "stray");
  EXPECT_EQ(folder.steps(), (std::vector<int64_t>{5}));
  const auto loaded = folder.load_latest();
  ASSERT_TRUE(loaded.found);
  EXPECT_EQ(loaded.step, 5);
  ASSERT_EQ(loaded.skipped.size(), 1u);
  EXPECT_NE(loaded.skipped[0].find("ckpt-99999999999999999999.cohort"), std::string::npos);
  EXPECT_NE(loaded.skipped[0].find("out of range"), std::string::npos) << loaded.skipped[0];
  folder.write(6, "next");  // rotation ignores it too
}

// Every checkpoint damaged: resume() is an error on every rank, naming the
// folder, the newest checkpoint's fault and the way to start over, and
// nothing is loaded or written.
TEST(TrainerCheckpoint, AllDamagedIsAnErrorOnEveryRank) {
  for (const bool zero : {false, true}) {
    TempDir dir("cohort-alldamaged-error");
    run_job({2, dir.str(), 6, 2, 2, "", false, true, zero});
    CheckpointDir folder(dir.str(), 2);
    ASSERT_EQ(folder.steps(), (std::vector<int64_t>{6, 4}));
    for (int64_t step : folder.steps()) {
      // ZeRO: damage that only the rank reading it meets, in the dcp folder.
      const auto file = zero ? folder.path_for(step) + ".dcp/__1_0.distcp" : folder.path_for(step);
      std::string bytes = slurp(file);
      bytes[bytes.size() / 2] ^= 0x40;
      dump(file, bytes);
    }
    const auto r = run_job({2, dir.str(), 8, 1, 2, "", true, true, zero});
    for (int rank = 0; rank < 2; ++rank) {
      const auto& e = r.errors[rank];
      EXPECT_NE(e.find("no checkpoint in " + dir.str() + " verifies (2 skipped"), std::string::npos)
          << "rank " << rank << ": " << e;
      EXPECT_NE(e.find("checksum mismatch"), std::string::npos) << e;
      EXPECT_NE(e.find("start_fresh_if_damaged"), std::string::npos) << e;
    }
    expect_equal_params(r.params, testing::make_mlp(99)->parameters());
    EXPECT_EQ(CheckpointDir(dir.str(), 2).steps(), (std::vector<int64_t>{6, 4}));
  }
}

// Every checkpoint damaged and start_fresh_if_damaged, then a resume with
// finer checkpoints: the job starts from step 0, says so in one line, and
// keeps what it writes.
TEST(TrainerCheckpoint, AllDamagedStartsFromZeroWhenAskedAndKeepsTheNewCheckpoint) {
  TempDir dir("cohort-alldamaged");
  run_job({2, dir.str(), 6, 2, 2, ""});
  CheckpointDir folder(dir.str(), 2);
  ASSERT_EQ(folder.steps(), (std::vector<int64_t>{6, 4}));
  for (int64_t step : folder.steps()) {
    dump(folder.path_for(step), slurp(folder.path_for(step)).substr(0, 40));
  }
  ::testing::internal::CaptureStderr();
  Job job{2, dir.str(), 3, 1, 2, "", true};
  job.start_fresh_if_damaged = true;
  const auto r = run_job(job);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_FALSE(r.resumed_at.has_value());
  EXPECT_EQ(r.skipped.size(), 2u);
  EXPECT_NE(
      err.find("no checkpoint in " + dir.str() + " verifies (2 skipped); starting from step 0"),
      std::string::npos)
      << err;
  const auto loaded = CheckpointDir(dir.str(), 2).load_latest();
  ASSERT_TRUE(loaded.found) << "the new good checkpoints were rotated out";
  EXPECT_EQ(loaded.step, 3);
}

}  // namespace
}  // namespace cohort::checkpoint_test
