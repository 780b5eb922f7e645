#include "cohort/train/dcp_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <memory>
#include <set>

#include "cohort/core/error.h"
#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/dcp.h"
#include "cohort/train/training_state.h"

namespace cohort {
namespace fs = std::filesystem;
namespace {
constexpr const char* kFolderSuffix = ".dcp";
constexpr const char* kSyncPrefix = "sync.rank";
constexpr const char* kBuffersPrefix = "buffers.rank";

std::string sync_prefix(int rank) { return kSyncPrefix + std::to_string(rank) + "."; }
std::string buffers_prefix(int rank) { return kBuffersPrefix + std::to_string(rank) + "."; }

// A tensor only this rank holds, whole, and writes.
dcp::TensorEntry own_entry(const std::string& fqn, const torch::Tensor& data) {
  dcp::TensorEntry e;
  e.fqn = fqn;
  e.shape = data.sizes().vec();
  e.dtype = data.scalar_type();
  e.shards.push_back({dcp::whole(e.shape), data});
  return e;
}

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

CheckpointDir::Check dcp_folder_check(std::string dir) {
  return [dir = std::move(dir)](int64_t step, const std::string& payload) {
    const auto path = CheckpointDir::path_in(dir, step);
    if (training_state_in_dcp(payload, path)) verify_dcp_folder(dcp_folder(path));
  };
}

void check_state_covers_model(const dcp::Metadata& meta, const dcp::StateDict& state,
                              Communicator& comm, const std::string& folder) {
  std::string mine;
  for (const auto& e : state.tensors) {
    if (e.fqn.rfind("model.", 0) == 0) mine += e.fqn + "\n";
  }
  const auto all = dcp::gather_strings(comm, mine, 0);
  std::string error;
  if (comm.rank() == 0) {
    std::set<std::string> asked;
    for (const auto& names : all) {
      for (size_t at = 0, end; (end = names.find('\n', at)) != std::string::npos; at = end + 1) {
        asked.insert(names.substr(at, end - at));
      }
    }
    std::vector<std::string> extra;
    for (const auto& t : meta.tensors) {
      if (t.fqn.rfind("model.", 0) == 0 && !asked.count(t.fqn)) extra.push_back(t.fqn);
    }
    if (!extra.empty()) {
      error = "checkpoint " + folder + " holds " + extra.front() +
              (extra.size() > 1 ? " and " + std::to_string(extra.size() - 1) + " more tensor(s)"
                                : std::string()) +
              " that this job's model does not have: resume with the model that wrote it";
    }
  }
  dcp::agree(comm, error);
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

void add_rank_buffers(dcp::StateDict& state, const torch::nn::Module& model, int rank) {
  for (const auto& b : model.named_buffers()) {
    // A copy: the next forward changes the buffers while an async save writes.
    state.tensors.push_back(
        own_entry(buffers_prefix(rank) + b.key(), b.value().detach().cpu().clone()));
  }
}

void add_rank_buffer_targets(dcp::StateDict& state, const dcp::Metadata& meta,
                             torch::nn::Module& model, int rank) {
  const auto prefix = buffers_prefix(rank);
  std::map<std::string, const dcp::TensorMeta*> saved;
  for (const auto& t : meta.tensors) {
    if (t.fqn.rfind(prefix, 0) == 0) saved[t.fqn.substr(prefix.size())] = &t;
  }
  auto loaded = std::make_shared<std::vector<std::pair<torch::Tensor, torch::Tensor>>>();
  for (const auto& b : model.named_buffers()) {
    const auto it = saved.find(b.key());
    // Another model's buffer of that name (another stage of a pipeline cut
    // otherwise) keeps the model's entry.
    if (it == saved.end() || it->second->shape != b.value().sizes().vec() ||
        it->second->dtype != b.value().scalar_type()) {
      continue;
    }
    auto target = torch::empty(it->second->shape, torch::TensorOptions().dtype(it->second->dtype));
    loaded->emplace_back(b.value(), target);
    state.tensors.push_back(own_entry(it->second->fqn, target));
  }
  state.after_load.push_back([loaded] {
    torch::NoGradGuard no_grad;
    for (auto& [buffer, value] : *loaded) buffer.copy_(value);
  });
}

void add_sync_state(dcp::StateDict& state, const std::map<std::string, torch::Tensor>& sync,
                    int rank) {
  for (const auto& [name, t] : sync) {
    state.tensors.push_back(own_entry(sync_prefix(rank) + name, t.detach().cpu().clone()));
  }
}

void add_sync_targets(dcp::StateDict& state, const dcp::Metadata& meta, int rank,
                      std::function<void(const std::map<std::string, torch::Tensor>&)> check,
                      std::function<void(const std::map<std::string, torch::Tensor>&)> install) {
  const auto prefix = sync_prefix(rank);
  auto loaded = std::make_shared<std::map<std::string, torch::Tensor>>();
  for (const auto& t : meta.tensors) {
    if (t.fqn.rfind(prefix, 0) != 0) continue;
    auto target = torch::empty(t.shape, torch::TensorOptions().dtype(t.dtype));
    (*loaded)[t.fqn.substr(prefix.size())] = target;
    state.tensors.push_back(own_entry(t.fqn, target));
  }
  state.check_before_load.push_back(
      [loaded,
       check = std::move(check)](const std::function<torch::Tensor(const torch::Tensor&)>& value) {
        std::map<std::string, torch::Tensor> staged;
        for (const auto& [name, target] : *loaded) staged[name] = value(target);
        check(staged);
      });
  state.after_load.push_back([loaded, install = std::move(install)] { install(*loaded); });
}

bool holds_sync_state(const dcp::Metadata& meta) {
  return std::any_of(meta.tensors.begin(), meta.tensors.end(),
                     [](const dcp::TensorMeta& t) { return t.fqn.rfind(kSyncPrefix, 0) == 0; });
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
