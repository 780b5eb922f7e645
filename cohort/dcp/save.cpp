// dcp::save: each rank writes its chunks to its own file; rank 0 gathers
// the chunk lists, checks that they cover every tensor exactly, and writes
// the metadata last (so a folder with metadata is a whole checkpoint).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/dcp.h"
#include "cohort/dcp/save_steps.h"

namespace cohort::dcp {
namespace {

// Which rank writes each replicated tensor: the least loaded so far, in
// the state dict's order (the same on every rank, so no exchange).
std::vector<int> replicated_writers(const StateDict& state, int world) {
  std::vector<int64_t> load(world, 0);
  std::vector<int> writer;
  for (const auto& t : state.tensors) {
    if (!t.replicated) {
      writer.push_back(-1);
      continue;
    }
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += whole(t.shape).numel() * static_cast<int64_t>(c10::elementSize(t.dtype));
    writer.push_back(r);
  }
  return writer;
}

std::vector<uint32_t> block_crcs(const char* data, int64_t bytes) {
  std::vector<uint32_t> crcs;
  for (int64_t off = 0; off < bytes; off += kBlockBytes) {
    crcs.push_back(crc32_of(data + off, static_cast<size_t>(std::min(kBlockBytes, bytes - off))));
  }
  return crcs;
}

// The folder and any missing parents (mkdir -p); a path that exists but is
// no folder is an error, as mkdir's.
void make_folder(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error("checkpoint " + dir + ": cannot create the folder: " + ec.message());
  if (!std::filesystem::is_directory(dir, ec)) {
    throw Error("checkpoint " + dir + ": cannot create the folder: a file of that name exists");
  }
}

// What a writer killed before its rename left in `dir`
// (write_file_atomically's "<name>.tmp.<pid>.<thread>"): a save into a
// folder an earlier attempt was writing would otherwise keep it for good.
// Called before any rank of this save writes.
void remove_temporary_files(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.path().filename().string().find(".tmp.") != std::string::npos) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
}

// Chunks start on cache-line boundaries in the staging arena, so every
// dtype's copy kernel sees aligned data.
int64_t aligned(size_t bytes) { return (static_cast<int64_t>(bytes) + 63) / 64 * 64; }

// An arena of at least `bytes`: the one given when it is large enough and
// no earlier save's views still hold it (its writer has finished), else a
// new one. Reuse matters: a new arena's pages fault in on first touch, which
// costs several times the copy itself.
void reserve_arena(torch::Tensor& arena, int64_t bytes) {
  if (arena.defined() && arena.numel() >= bytes && arena.storage().use_count() == 1) return;
  arena = torch::empty({bytes}, torch::kUInt8);
}

}  // namespace

void check_shards(const StateDict& state, const std::string& op, int rank) {
  for (const auto& t : state.tensors) {
    for (const auto& s : t.shards) {
      const auto sizes = s.data.sizes().vec();
      if (sizes == s.box.lengths && s.data.scalar_type() == t.dtype) continue;
      const auto on = rank >= 0 ? " on rank " + std::to_string(rank) : std::string();
      throw InvalidArgument(op + ": tensor " + t.fqn + on + ": the shard's data is " +
                            shape_string(sizes) + " " + dtype_name(s.data.scalar_type()) +
                            ", its box " + to_string(s.box) + " is " + shape_string(s.box.lengths) +
                            " " + dtype_name(t.dtype));
    }
  }
}

const StateDict& current(const StateDict& state, StateDict& rebuilt, const std::string& op,
                         int rank) {
  std::string why;
  for (const auto& f : state.stale) {
    why = f();
    if (!why.empty()) break;
  }
  if (why.empty()) return state;
  const auto where = op + (rank >= 0 ? " on rank " + std::to_string(rank) : std::string()) +
                     ": the state dict is out of date (" + why + ")";
  if (!state.rebuild) throw InvalidArgument(where + ": call get_state_dict again");
  try {
    rebuilt = state.rebuild(state);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where + " and cannot be made again: " + e.what() +
                          "; call get_state_dict again");
  }
  return rebuilt;
}

StagedFile stage_rank_file(const StateDict& state, int rank, int world, torch::Tensor* arena,
                           const std::string& op) {
  // Only sizes that equal the box's: a shard of the same numel shaped
  // otherwise would be written permuted.
  check_shards(state, op, rank);
  const auto writer = replicated_writers(state, world);
  auto written = [&](size_t i) {
    return state.tensors[i].write && (!state.tensors[i].replicated || writer[i] == rank);
  };
  if (arena) {
    int64_t bytes = 0;
    for (size_t i = 0; i < state.tensors.size(); ++i) {
      if (!written(i)) continue;
      for (const auto& s : state.tensors[i].shards) bytes += aligned(s.data.nbytes());
    }
    reserve_arena(*arena, bytes);
  }
  StagedFile staged;
  staged.modules = state.modules;
  staged.tensors = nlohmann::json::array();
  int64_t offset = 0, at = 0;
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    const auto& t = state.tensors[i];
    if (!written(i)) continue;
    nlohmann::json chunks = nlohmann::json::array();
    for (const auto& s : t.shards) {
      if (s.box.numel() == 0) continue;
      torch::Tensor data;
      if (arena) {
        // Only the place: the caller copies (async_save, partly on its
        // staging thread).
        const auto bytes = static_cast<int64_t>(s.data.nbytes());
        data = arena->narrow(0, at, bytes).view(t.dtype).view(s.data.sizes());
        // As the state dict holds it: async_save tells a parameter (it
        // requires grad) from a buffer.
        staged.sources.push_back(s.data);
        staged.source_fqns.push_back(t.fqn);
        at += aligned(bytes);
      } else {
        data = s.data.detach().cpu().contiguous();
      }
      chunks.push_back(
          {{"offsets", s.box.offsets}, {"lengths", s.box.lengths}, {"byte_offset", offset}});
      offset += static_cast<int64_t>(data.nbytes());
      staged.data.push_back(std::move(data));
    }
    staged.tensors.push_back(
        {{"fqn", t.fqn}, {"shape", t.shape}, {"dtype", dtype_name(t.dtype)}, {"chunks", chunks}});
  }
  staged.bytes = offset;
  staged.plan = plan_of(state, staged);
  return staged;
}

std::string write_staged_file(StagedFile& staged, const std::string& dir, int rank) {
  make_folder(dir);
  std::vector<std::pair<const void*, size_t>> pieces;
  size_t next = 0;
  for (auto& t : staged.tensors) {
    for (auto& c : t.at("chunks")) {
      const auto& data = staged.data.at(next++);
      const auto* bytes = static_cast<const char*>(data.data_ptr());
      pieces.emplace_back(bytes, data.nbytes());
      c["crc32"] = block_crcs(bytes, static_cast<int64_t>(data.nbytes()));
    }
  }
  write_file_atomically(dir + "/" + data_file_name(rank), pieces);
  return nlohmann::json{
      {"bytes", staged.bytes}, {"tensors", staged.tensors}, {"modules", staged.modules}}
      .dump();
}

namespace {

// Rank 0: every rank's chunk lists as one Metadata; checks that the ranks
// agree on each tensor and that its chunks tile it.
Metadata merge(const std::vector<std::string>& lists) {
  std::map<std::string, TensorMeta> by_name;
  std::set<std::string> modules;
  Metadata meta;
  for (size_t r = 0; r < lists.size(); ++r) {
    const auto j = nlohmann::json::parse(lists[r]);
    // Every rank's submodules: a pipeline's ranks each hold their own stages.
    for (const auto& m : j.at("modules")) modules.insert(m.get<std::string>());
    meta.files.push_back({data_file_name(static_cast<int>(r)), j.at("bytes").get<int64_t>()});
    for (const auto& t : j.at("tensors")) {
      const std::string fqn = t.at("fqn");
      const auto shape = t.at("shape").get<std::vector<int64_t>>();
      const auto dtype = dtype_from_name(t.at("dtype"));
      auto [it, fresh] = by_name.try_emplace(fqn);
      if (fresh) {
        it->second.fqn = fqn;
        it->second.shape = shape;
        it->second.dtype = dtype;
      } else if (it->second.shape != shape || it->second.dtype != dtype) {
        throw InvalidArgument("dcp::save: tensor " + fqn + ": rank " + std::to_string(r) +
                              " has another shape or dtype than a lower rank");
      }
      for (const auto& c : t.at("chunks")) {
        ChunkMeta cm;
        cm.box.offsets = c.at("offsets").get<std::vector<int64_t>>();
        cm.box.lengths = c.at("lengths").get<std::vector<int64_t>>();
        cm.byte_offset = c.at("byte_offset");
        cm.crc32 = c.at("crc32").get<std::vector<uint32_t>>();
        cm.file = static_cast<int>(r);
        it->second.chunks.push_back(std::move(cm));
      }
    }
  }
  for (auto& [fqn, t] : by_name) {
    const auto error = tiling_error(t);
    if (!error.empty()) {
      throw InvalidArgument("dcp::save: tensor " + fqn +
                            ": the ranks' shards do not tile it: " + error);
    }
    meta.tensors.push_back(std::move(t));
  }
  meta.modules.assign(modules.begin(), modules.end());
  return meta;
}

}  // namespace

std::string data_file_name(int rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

std::string prepare_folder(const std::string& dir) {
  // No metadata while the data files change: a crash leaves no checkpoint
  // rather than one whose files disagree.
  try {
    make_folder(dir);
    remove_temporary_files(dir);
    const auto meta = dir + "/" + kMetadataName;
    if (::unlink(meta.c_str()) != 0 && errno != ENOENT) {
      throw Error("checkpoint " + meta + ": unlink failed: " + std::strerror(errno));
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> gather_lists(Communicator& comm, const std::string& list,
                                      const std::string& error, ErrorKind kind) {
  agree(comm, error, kind);
  return gather_strings(comm, list, 0);
}

void write_metadata_file(const std::vector<std::string>& lists, const std::string& dir) {
  write_checkpoint_file(dir + "/" + kMetadataName, metadata_to_json(merge(lists)));
}

void write_metadata(Communicator& comm, const std::string& dir,
                    const std::vector<std::string>& lists) {
  std::string error;
  if (comm.rank() == 0) {
    try {
      write_metadata_file(lists, dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  agree(comm, error);
}

void commit(Communicator& comm, const std::string& dir, const std::string& list,
            const std::string& error, ErrorKind kind) {
  write_metadata(comm, dir, gather_lists(comm, list, error, kind));
}

void save(const StateDict& state, const std::string& dir, Communicator& comm) {
  finish_pending_save(comm);
  // Every check first: a save refused on any rank leaves the folder, and the
  // checkpoint in it, as they were.
  std::string error;
  ErrorKind kind = ErrorKind::Checkpoint;
  StagedFile staged;
  const std::string op = "dcp::save";  // named: a temporary would read as dangling
  try {
    StateDict rebuilt;
    const auto& now = current(state, rebuilt, op, comm.rank());
    for (const auto& f : now.check_model) f(op);
    for (const auto& f : now.refresh) f();
    staged = stage_rank_file(now, comm.rank(), comm.size(), nullptr, op);
  } catch (const std::exception& e) {
    error = e.what();
    kind = kind_of(e);
  }
  agree_on_plan(comm, staged.plan, error, kind, op);
  error = comm.rank() == 0 ? prepare_folder(dir) : "";
  agree(comm, error);
  std::string list;
  try {
    list = write_staged_file(staged, dir, comm.rank());
  } catch (const std::exception& e) {
    error = e.what();
  }
  commit(comm, dir, list, error);
}

}  // namespace cohort::dcp
