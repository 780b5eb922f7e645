#include "cohort/train/checkpoint_dir.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <functional>

#include "cohort/core/error.h"
#include "cohort/train/checkpoint_file.h"

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
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return std::nullopt;
  return std::stoll(digits);
}

}  // namespace

CheckpointDir::CheckpointDir(std::string dir, int keep_last)
    : dir_(std::move(dir)), keep_last_(keep_last) {
  if (keep_last_ < 1) {
    throw InvalidArgument("CheckpointDir: keep_last must be at least 1, got " +
                          std::to_string(keep_last_));
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw Error("checkpoint folder " + dir_ + ": cannot create: " + ec.message());
}

std::string CheckpointDir::path_for(int64_t step) const {
  char name[64];
  std::snprintf(name, sizeof(name), "%s%010lld%s", kPrefix, static_cast<long long>(step), kSuffix);
  return (fs::path(dir_) / name).string();
}

void CheckpointDir::write(int64_t step, const std::string& payload) const {
  write_checkpoint_file(path_for(step), payload);
  const auto all = steps();
  for (size_t i = static_cast<size_t>(keep_last_); i < all.size(); ++i) {
    std::error_code ec;
    fs::remove(path_for(all[i]), ec);
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

CheckpointDir::Loaded CheckpointDir::load_latest() const {
  Loaded loaded;
  for (int64_t step : steps()) {
    try {
      loaded.payload = read_checkpoint_file(path_for(step));
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
