// defines: save_torch, load_torch, is_torch_file: a state dict in the file
// format of Python's torch.save (a zip holding a pickle and one record per
// tensor).
//
// save_torch writes the pickle Python's torch.save writes for a dict of
// tensors, so torch.load(path) reads it, with weights_only=True too (the
// default of PyTorch 2.6); load_torch reads through LibTorch's unpickler
// (torch::pickle_load).
// load_torch reads a dict of tensors that Python's torch.save wrote in its
// default zip format; save `dict(model.state_dict())`: LibTorch 1.13's
// unpickler turns an OrderedDict into None. The legacy format
// (_use_new_zipfile_serialization=False) is not read: a clear error says so.
// Unlike safetensors, the file is read whole.
#pragma once

#include <string>

#include "cohort/dcp/safetensors.h"

namespace cohort::dcp {

/// Writes `tensors` (as their values: contiguous CPU copies, without
/// autograd history) to `path` atomically as torch.save writes a dict (the
/// file is built in memory first).
void save_torch(const NamedTensors& tensors, const std::string& path);

/// Whether `path` starts as a torch.save file does (a zip, or the legacy
/// format's magic number; a safetensors file starts with its header length).
bool is_torch_file(const std::string& path);

/// Reads a dict of tensors written by torch.save or save_torch. Throws
/// CheckpointError naming the file (and the key) when it is not one.
NamedTensors load_torch(const std::string& path);

}  // namespace cohort::dcp
