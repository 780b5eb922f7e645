#include "cohort/train/dcp_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <set>

#include "cohort/core/error.h"
#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/dcp.h"

namespace cohort {
namespace fs = std::filesystem;
namespace {
constexpr const char* kFolderSuffix = ".dcp";
}  // namespace

std::string dcp_folder(const std::string& checkpoint_path) {
  return checkpoint_path + kFolderSuffix;
}

void verify_dcp_folder(const std::string& folder) {
  const auto meta = dcp::read_metadata(folder);
  for (const auto& f : meta.files) {
    const auto path = (fs::path(folder) / f.name).string();
    std::error_code ec;
    const auto bytes = fs::file_size(path, ec);
    if (ec) throw CheckpointError("checkpoint " + path + ": cannot read: " + ec.message());
    if (static_cast<int64_t>(bytes) != f.bytes) {
      throw CheckpointError("checkpoint " + path + ": " + std::to_string(bytes) +
                            " bytes, the metadata says " + std::to_string(f.bytes));
    }
  }
}

void save_buffers_from_rank0(dcp::StateDict& state, torch::nn::Module& model, int rank) {
  std::set<std::string> buffers;
  for (const auto& b : model.named_buffers()) buffers.insert("model." + b.key());
  for (auto& e : state.tensors) {
    if (!e.replicated || !buffers.count(e.fqn)) continue;
    e.replicated = false;
    if (rank != 0) e.shards.clear();
  }
}

void remove_orphan_dcp_folders(const CheckpointDir& dir, int64_t keep_step) {
  const auto kept = dir.steps();
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir.dir(), ec)) {
    if (!entry.is_directory(ec)) continue;
    const auto path = entry.path().string();
    bool keep = dcp_folder(dir.path_for(keep_step)) == path;
    for (int64_t step : kept) keep = keep || dcp_folder(dir.path_for(step)) == path;
    const std::string suffix = kFolderSuffix;
    const bool ours = path.size() > suffix.size() &&
                      path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0 &&
                      entry.path().filename().string().rfind("ckpt-", 0) == 0;
    if (ours && !keep) fs::remove_all(entry.path(), ec);
  }
}

}  // namespace cohort
