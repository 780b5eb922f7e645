#include "cohort/train/checkpoint_dir.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>

#include "cohort/core/error.h"
#include "cohort/dcp/checkpoint_file.h"

namespace cohort {
namespace fs = std::filesystem;
namespace {

constexpr const char* kPrefix = "ckpt-";
constexpr const char* kSuffix = ".cohort";

// The step of a final checkpoint name, nullopt for anything else.
std::optional<int64_t> step_of(const std::string& name) {
  const std::string prefix = kPrefix, suffix = kSuffix;
  if (name.size() <= prefix.size() + suffix.size()) return std::nullopt;
  if (name.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  if (name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return std::nullopt;
  const std::string digits =
      name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return std::nullopt;
  errno = 0;
  const long long step = std::strtoll(digits.c_str(), nullptr, 10);
  if (errno == ERANGE) return std::nullopt;  // reported by out_of_range_names()
  return step;
}

// Names shaped like a checkpoint whose step does not fit an int64 (a stray
// or hand-made file): skipped, with a message, rather than failing resume.
std::vector<std::string> out_of_range_names(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto name = entry.path().filename().string();
    const std::string suffix = kSuffix;
    if (name.rfind(kPrefix, 0) != 0 || name.size() <= suffix.size() + 5 ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const auto digits = name.substr(5, name.size() - 5 - suffix.size());
    if (std::all_of(digits.begin(), digits.end(), ::isdigit) && !step_of(name)) {
      out.push_back("checkpoint " + entry.path().string() +
                    ": the step number in the name is out of range (not a cohort checkpoint)");
    }
  }
  return out;
}

}  // namespace

CheckpointDir::CheckpointDir(std::string dir, int keep_last, Check whole)
    : dir_(std::move(dir)), keep_last_(keep_last), whole_(std::move(whole)) {
  if (keep_last_ < 1) {
    throw InvalidArgument("CheckpointDir: keep_last must be at least 1, got " +
                          std::to_string(keep_last_));
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw Error("checkpoint folder " + dir_ + ": cannot create: " + ec.message());
}

std::string CheckpointDir::path_in(const std::string& dir, int64_t step) {
  char name[64];
  std::snprintf(name, sizeof(name), "%s%010lld%s", kPrefix, static_cast<long long>(step), kSuffix);
  return (fs::path(dir) / name).string();
}

bool CheckpointDir::verifies(int64_t step) const {
  if (verified_.count(step)) return true;
  try {
    const auto payload = read_checkpoint_file(path_for(step));
    if (whole_) whole_(step, payload);
  } catch (const CheckpointError&) {
    return false;
  }
  verified_.insert(step);
  return true;
}

void CheckpointDir::write(int64_t step, const std::string& payload) const {
  write_checkpoint_file(path_for(step), payload);
  verified_.insert(step);
  // Keep the step just written and the newest others that verify and are
  // whole, keep_last in all. Those that are not count for nothing and are
  // left alone: counting them could rotate out the only good checkpoint.
  int kept = 1;
  for (int64_t other : steps()) {
    if (other == step || !verifies(other)) continue;
    if (kept < keep_last_) {
      ++kept;
      continue;
    }
    std::error_code ec;
    fs::remove(path_for(other), ec);
    verified_.erase(other);
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const auto name = entry.path().filename().string();
    if (name.rfind(kPrefix, 0) == 0 && name.find(".tmp.") != std::string::npos) {
      fs::remove(entry.path(), ec);
    }
  }
}

std::vector<int64_t> CheckpointDir::steps() const {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    if (auto step = step_of(entry.path().filename().string())) out.push_back(*step);
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

CheckpointDir::Loaded CheckpointDir::load_latest(const Check& check, int64_t below) const {
  Loaded loaded;
  loaded.skipped = out_of_range_names(dir_);
  for (int64_t step : steps()) {
    if (step >= below) continue;
    try {
      loaded.payload = read_checkpoint_file(path_for(step));
      if (whole_) whole_(step, loaded.payload);
      if (check) check(step, loaded.payload);
      loaded.step = step;
      loaded.found = true;
      return loaded;
    } catch (const CheckpointError& e) {
      loaded.skipped.push_back(e.what());
    }
  }
  return loaded;
}

std::string CheckpointDir::load(int64_t step) const { return read_checkpoint_file(path_for(step)); }

}  // namespace cohort
