// dcp::load: for every box this rank holds, reads the checksum blocks of
// the stored chunks that overlap it (pread), verifies them and copies the
// overlap into a staging tensor; only when every rank has all it needs are
// the staged values copied into the model and optimizer.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <unordered_map>

#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/dcp.h"
#include "cohort/dcp/save_steps.h"

namespace cohort::dcp {
namespace {

// The data files one load reads, each opened (and its size checked) once.
class DataFiles {
 public:
  DataFiles(std::string dir, const Metadata& meta) : dir_(std::move(dir)), meta_(meta) {}
  ~DataFiles() {
    for (auto& [file, fd] : fds_) ::close(fd);
  }
  DataFiles(const DataFiles&) = delete;
  DataFiles& operator=(const DataFiles&) = delete;

  std::string path(int file) const { return dir_ + "/" + meta_.files[file].name; }

  int fd(int file) {
    if (auto it = fds_.find(file); it != fds_.end()) return it->second;
    const auto p = path(file);
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw CheckpointError("checkpoint " + p + ": cannot open: " + std::strerror(errno));
    fds_[file] = fd;
    struct stat st = {};
    if (::fstat(fd, &st) != 0) {
      throw CheckpointError("checkpoint " + p + ": fstat failed: " + std::strerror(errno));
    }
    if (st.st_size != meta_.files[file].bytes) {
      throw CheckpointError("checkpoint " + p + ": " +
                            (st.st_size < meta_.files[file].bytes ? "truncated" : "wrong size") +
                            ": " + std::to_string(st.st_size) + " bytes, the metadata says " +
                            std::to_string(meta_.files[file].bytes));
    }
    return fd;
  }

  // Bytes [begin, end) of chunk `c`, widened to whole checksum blocks and
  // verified; returns them with the offset of `begin` inside.
  std::pair<torch::Tensor, int64_t> read(const TensorMeta& t, const ChunkMeta& c, int64_t begin,
                                         int64_t end) {
    const int64_t chunk_bytes = c.box.numel() * static_cast<int64_t>(c10::elementSize(t.dtype));
    const auto p = path(c.file);
    if (static_cast<int64_t>(c.crc32.size()) != (chunk_bytes + kBlockBytes - 1) / kBlockBytes) {
      throw CheckpointError("checkpoint " + p + ": tensor " + t.fqn + ": the chunk " +
                            to_string(c.box) + " has the wrong number of checksums");
    }
    const int64_t b0 = begin / kBlockBytes, b1 = (end - 1) / kBlockBytes;
    const int64_t from = b0 * kBlockBytes, to = std::min((b1 + 1) * kBlockBytes, chunk_bytes);
    auto buf = torch::empty({to - from}, torch::kByte);
    auto* out = static_cast<char*>(buf.data_ptr());
    const int f = fd(c.file);
    for (int64_t done = 0; done < to - from;) {
      const ssize_t n = ::pread(f, out + done, static_cast<size_t>(to - from - done),
                                static_cast<off_t>(c.byte_offset + from + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        throw CheckpointError(
            "checkpoint " + p + ": read failed" +
            (n == 0 ? std::string(": truncated") : ": " + std::string(std::strerror(errno))));
      }
      done += n;
    }
    for (int64_t b = b0; b <= b1; ++b) {
      const int64_t at = b * kBlockBytes - from;
      const auto n = std::min(kBlockBytes, chunk_bytes - b * kBlockBytes);
      const auto crc = crc32_of(out + at, static_cast<size_t>(n));
      if (crc != c.crc32[b]) {
        char text[64];
        std::snprintf(text, sizeof(text), "stored crc32 %08x, data has %08x", c.crc32[b], crc);
        throw CheckpointError("checkpoint " + p + ": checksum mismatch in tensor " + t.fqn +
                              ", chunk " + to_string(c.box) + ", block " + std::to_string(b) +
                              ": " + text);
      }
    }
    return {buf, begin - from};
  }

 private:
  std::string dir_;
  const Metadata& meta_;
  std::map<int, int> fds_;
};

// Copies the overlap of chunk `c` with `target` into `staged` (shaped as
// target); returns the elements copied.
int64_t read_overlap(const TensorMeta& t, const ChunkMeta& c, const Box& target,
                     torch::Tensor& staged, DataFiles& files) {
  const Box in = intersect(c.box, target);
  if (in.numel() == 0 || c.box.numel() == 0) return 0;
  const auto es = static_cast<int64_t>(c10::elementSize(t.dtype));
  const size_t dims = c.box.lengths.size();
  std::vector<int64_t> strides(dims, 1);
  for (size_t d = dims; d-- > 1;) strides[d - 1] = strides[d] * c.box.lengths[d];
  int64_t first = 0, last = 0;
  for (size_t d = 0; d < dims; ++d) {
    first += (in.offsets[d] - c.box.offsets[d]) * strides[d];
    last += (in.offsets[d] + in.lengths[d] - 1 - c.box.offsets[d]) * strides[d];
  }
  auto [buf, at] = files.read(t, c, first * es, (last + 1) * es);
  auto src = torch::from_blob(static_cast<char*>(buf.data_ptr()) + at, in.lengths, strides,
                              torch::TensorOptions().dtype(t.dtype));
  auto dst = staged;
  for (size_t d = 0; d < dims; ++d) {
    dst = dst.narrow(static_cast<int64_t>(d), in.offsets[d] - target.offsets[d], in.lengths[d]);
  }
  dst.copy_(src);
  return in.numel();
}

// The staged values of every shard of `state`, in order; throws
// CheckpointError naming the tensor or file.
std::vector<torch::Tensor> stage(const StateDict& state, const std::string& dir,
                                 const Metadata& meta, int rank) {
  check_shards(state, "dcp::load", rank);
  check_fits(state, meta, dir);
  DataFiles files(dir, meta);
  std::vector<torch::Tensor> staged;
  for (const auto& e : state.tensors) {
    const auto* t = meta.find(e.fqn);
    const std::string where = "checkpoint " + dir + ": tensor " + e.fqn;
    for (const auto& s : e.shards) {
      // The files' sizes first: the metadata keeps every chunk inside its
      // file, so what is allocated below is at most what is on disk.
      for (const auto& c : t->chunks) {
        if (intersect(c.box, s.box).numel() > 0) files.fd(c.file);
      }
      auto out = torch::empty(s.box.lengths, torch::TensorOptions().dtype(e.dtype));
      int64_t covered = 0;
      for (const auto& c : t->chunks) covered += read_overlap(*t, c, s.box, out, files);
      if (covered != s.box.numel()) {
        throw CheckpointError(where + ": the checkpoint holds " + std::to_string(covered) +
                              " of the " + std::to_string(s.box.numel()) + " elements of " +
                              to_string(s.box));
      }
      staged.push_back(std::move(out));
    }
  }
  return staged;
}

}  // namespace

void check_fits(const StateDict& state, const Metadata& meta, const std::string& dir) {
  for (const auto& e : state.tensors) {
    const auto* t = meta.find(e.fqn);
    const std::string where = "checkpoint " + dir + ": tensor " + e.fqn;
    if (!t) throw CheckpointError(where + " is not in the checkpoint");
    if (t->shape != e.shape) {
      throw CheckpointError(where + ": the checkpoint's shape " + shape_string(t->shape) +
                            " differs from the model's " + shape_string(e.shape));
    }
    if (t->dtype != e.dtype) {
      throw CheckpointError(where + ": the checkpoint's dtype " + dtype_name(t->dtype) +
                            " differs from the model's " + dtype_name(e.dtype));
    }
  }
}

Metadata read_metadata(const std::string& dir) {
  const auto path = dir + "/" + kMetadataName;
  return metadata_from_json(read_checkpoint_file(path), path);
}

namespace {

// Runs state.check_before_load on the staged values (staged[k] is what
// shard k, in order, is about to take).
void check_staged(const StateDict& state, const std::vector<torch::Tensor>& staged) {
  if (state.check_before_load.empty()) return;
  std::unordered_map<const void*, torch::Tensor> value_of;
  size_t k = 0;
  for (const auto& e : state.tensors) {
    for (const auto& s : e.shards) value_of[s.data.unsafeGetTensorImpl()] = staged[k++];
  }
  auto value = [&](const torch::Tensor& data) {
    auto it = value_of.find(data.unsafeGetTensorImpl());
    COHORT_CHECK(it != value_of.end(), "dcp::load: a check asked for a tensor that is no shard");
    return it->second;
  };
  for (const auto& check : state.check_before_load) check(value);
}

// Stages every shard of `state` (unless a rank failed before: `error`),
// agrees, then copies the staged values in and runs after_load.
void fill(StateDict& state, const std::string& dir, Communicator& comm, const Metadata& meta,
          std::string error, ErrorKind kind = ErrorKind::Checkpoint) {
  std::vector<torch::Tensor> staged;
  if (error.empty()) {
    try {
      for (const auto& f : state.check_model) f("dcp::load");
      staged = stage(state, dir, meta, comm.rank());
      check_staged(state, staged);
    } catch (const std::exception& e) {
      error = e.what();
      kind = kind_of(e);
    }
  }
  agree(comm, error, kind);
  torch::NoGradGuard no_grad;
  size_t k = 0;
  for (auto& e : state.tensors) {
    for (auto& s : e.shards) s.data.copy_(staged[k++].view(s.data.sizes()));
  }
  for (auto& f : state.after_load) f();
}

}  // namespace

void load(StateDict& state, const std::string& dir, Communicator& comm, const Metadata* meta) {
  // A save pending into this folder is committed first: until then the
  // folder holds no .metadata. Its error, if it failed, is every rank's.
  finish_pending_save_into(comm, dir);
  // A save still staging reads the tensors this load writes into; a copy
  // that did not finish in time fails the load on every rank (agreed below).
  std::string error = wait_pending_staging(comm);
  Metadata read;
  if (!meta) {
    try {
      if (error.empty()) read = read_metadata(dir);
    } catch (const std::exception& e) {
      error = e.what();
    }
    meta = &read;
  }
  if (!state.load_targets) {
    fill(state, dir, comm, *meta, error);
    return;
  }
  // The targets depend on the metadata, and building a tensor-parallel
  // stage's is collective: every rank gets there with the metadata read.
  agree(comm, error);
  StateDict targets;
  ErrorKind kind = ErrorKind::Checkpoint;
  try {
    targets = state.load_targets(*meta);
  } catch (const CheckpointError&) {
    throw;  // the ranks agreed on it already (a layout that cannot hold a tensor)
  } catch (const std::exception& e) {
    error = e.what();
    kind = kind_of(e);
  }
  fill(targets, dir, comm, *meta, error, kind);
  // The caller's state dict becomes what was loaded: it views all the model
  // and optimizer now hold (state that did not exist before included), so
  // set_state_dict(sd) and a later save see it.
  targets.load_targets = std::move(state.load_targets);
  state = std::move(targets);
}

torch::Tensor read_tensor(const std::string& dir, const Metadata& meta, const std::string& fqn) {
  const auto* t = meta.find(fqn);
  if (!t)
    throw CheckpointError("checkpoint " + dir + ": tensor " + fqn + " is not in the checkpoint");
  StateDict one;
  auto full = torch::empty(t->shape, torch::TensorOptions().dtype(t->dtype));
  one.tensors.push_back({fqn, t->shape, t->dtype, false, {{whole(t->shape), full}}});
  auto staged = stage(one, dir, meta, 0);
  return staged.empty() ? full : staged[0];
}

}  // namespace cohort::dcp
