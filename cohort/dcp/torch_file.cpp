#include "cohort/dcp/torch_file.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/serialize.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "cohort/core/dtypes.h"
#include "cohort/dcp/checkpoint_file.h"

namespace cohort::dcp {

namespace {

// The name of a dtype's storage class in Python's torch.save pickles.
const char* storage_class(torch::Dtype dtype) {
  if (const DtypeInfo* d = find_dtype(dtype)) return d->storage;
  throw Unsupported(std::string("save_torch: dtype ") + c10::toString(dtype) + " is not supported");
}

// Pickle protocol 2, the opcodes a state dict needs. torch::pickle_save
// would tag the dict with torch.jit._pickle.restore_type_tag, which
// torch.load(weights_only=True), PyTorch 2.x's default, refuses; this
// writes what Python's torch.save writes for a dict of tensors.
struct Pickle {
  std::string out = "\x80\x02";
  void op(char c) { out += c; }
  void global(const std::string& module, const std::string& name) {
    out += 'c' + module + '\n' + name + '\n';
  }
  void str(const std::string& s) {
    const auto n = static_cast<uint32_t>(s.size());
    out += 'X';
    out.append(reinterpret_cast<const char*>(&n), 4);
    out += s;
  }
  void integer(int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
      const auto w = static_cast<int32_t>(v);
      out += 'J';
      out.append(reinterpret_cast<const char*>(&w), 4);
    } else {
      out += "\x8a\x08";  // LONG1: 8 bytes, little-endian two's complement
      out.append(reinterpret_cast<const char*>(&v), 8);
    }
  }
  void ints(at::IntArrayRef v) {
    op('(');
    for (auto x : v) integer(x);
    op('t');
  }
  // torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False,
  // OrderedDict()), its storage the persistent id ('storage', class, key,
  // 'cpu', numel) whose bytes are the record data/<key>.
  void tensor(const torch::Tensor& t, const std::string& key) {
    global("torch._utils", "_rebuild_tensor_v2");
    op('(');
    op('(');
    str("storage");
    global("torch", storage_class(t.scalar_type()));
    str(key);
    str("cpu");
    integer(t.numel());
    op('t');
    op('Q');  // BINPERSID
    integer(0);
    ints(t.sizes());
    ints(t.strides());
    op('\x89');  // False
    global("collections", "OrderedDict");
    op(')');
    op('R');
    op('t');
    op('R');
  }
};

}  // namespace

void save_torch(const NamedTensors& tensors, const std::string& path) {
  std::vector<torch::Tensor> values;
  Pickle p;
  p.op('}');
  p.op('(');
  for (const auto& item : tensors) {
    values.push_back(item.value().detach().to(torch::kCPU).contiguous());
    p.str(item.key());
    p.tensor(values.back(), std::to_string(values.size() - 1));
  }
  p.op('u');
  p.op('.');
  std::string bytes;
  {
    caffe2::serialize::PyTorchStreamWriter zip([&](const void* data, size_t n) {
      bytes.append(static_cast<const char*>(data), n);
      return n;
    });
    zip.writeRecord("data.pkl", p.out.data(), p.out.size());
    zip.writeRecord("byteorder", "little", 6);
    for (size_t k = 0; k < values.size(); ++k) {
      zip.writeRecord("data/" + std::to_string(k), values[k].data_ptr(), values[k].nbytes());
    }
    zip.writeEndOfFile();
  }
  write_file_atomically(path, {{bytes.data(), bytes.size()}});
}

namespace {
// Python's torch.save writes a zip since 1.6; before, a pickle stream that
// starts with this magic number (protocol 2, LONG1 of 10 bytes).
constexpr char kZipMagic[4] = {'P', 'K', 3, 4};
constexpr unsigned char kLegacyMagic[13] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c,
                                            0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50};
}  // namespace

bool is_torch_file(const std::string& path) {
  char magic[13] = {};
  std::ifstream in(path, std::ios::binary);
  in.read(magic, 13);
  return (in.gcount() >= 4 && std::memcmp(magic, kZipMagic, 4) == 0) ||
         (in.gcount() == 13 && std::memcmp(magic, kLegacyMagic, 13) == 0);
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
    std::string what = e.what_without_backtrace();
    // Some LibTorch releases unpickle collections.OrderedDict as None.
    if (what.find("got None") != std::string::npos) {
      what =
          "an OrderedDict (a state_dict() saved as it is) reads as None in this LibTorch: "
          "save dict(model.state_dict()) (" +
          what + ")";
    }
    throw CheckpointError("torch file " + path + ": " + what);
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
      throw CheckpointError("torch file " + path + ": " + name + " is a " + item.value().tagKind() +
                            ", not a tensor");
    }
    out.insert(name, item.value().toTensor());
  }
  return out;
}

}  // namespace cohort::dcp
