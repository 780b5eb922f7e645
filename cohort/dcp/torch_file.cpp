#include "cohort/dcp/torch_file.h"

#include <torch/serialize.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "cohort/dcp/checkpoint_file.h"

namespace cohort::dcp {

void save_torch(const NamedTensors& tensors, const std::string& path) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& item : tensors) {
    // A clone: the pickler writes a view's whole storage, and its
    // requires_grad flag, which Python would then see.
    dict.insert(item.key(), item.value().detach().to(torch::kCPU).clone(at::MemoryFormat::Contiguous));
  }
  const auto bytes = torch::pickle_save(dict);
  write_file_atomically(path, {{bytes.data(), bytes.size()}});
}

namespace {
// Python's torch.save writes a zip since 1.6; before, a pickle stream.
constexpr char kZipMagic[4] = {'P', 'K', 3, 4};
}  // namespace

bool is_torch_file(const std::string& path) {
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  return in.read(magic, 4) && std::memcmp(magic, kZipMagic, 4) == 0;
}

NamedTensors load_torch(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw CheckpointError("torch file " + path + ": cannot open: " + std::strerror(errno));
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  if (bytes.size() < 4 || std::memcmp(bytes.data(), kZipMagic, 4) != 0) {
    throw CheckpointError("torch file " + path +
                          ": not a zip archive: only torch.save's default zip format is read "
                          "(not the legacy format of _use_new_zipfile_serialization=False)");
  }
  torch::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    throw CheckpointError("torch file " + path + ": " + e.what_without_backtrace());
  }
  if (value.isNone()) {
    throw CheckpointError("torch file " + path +
                          ": holds None: an OrderedDict (a state_dict() saved as it is) reads as "
                          "None in this LibTorch; save dict(model.state_dict())");
  }
  if (!value.isGenericDict()) {
    throw CheckpointError("torch file " + path + ": holds a " + value.tagKind() +
                          ", not a dict of tensors");
  }
  NamedTensors out;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString()) {
      throw CheckpointError("torch file " + path + ": a key is a " + item.key().tagKind() +
                            ", not a string");
    }
    const auto& name = item.key().toStringRef();
    if (!item.value().isTensor()) {
      throw CheckpointError("torch file " + path + ": " + name + " is a " +
                            item.value().tagKind() + ", not a tensor");
    }
    out.insert(name, item.value().toTensor());
  }
  return out;
}

}  // namespace cohort::dcp
