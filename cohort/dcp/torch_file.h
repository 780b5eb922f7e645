// defines: save_torch and load_torch: a state dict in the file format of
// Python's torch.save (a zip holding a pickle and one record per tensor),
// through LibTorch's own pickler (torch::pickle_save / pickle_load).
//
// Python reads what save_torch writes with torch.load(path) (also with
// weights_only=True: the pickle holds only a dict, strings and tensors).
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
/// autograd history) to `path` atomically as torch.save writes a dict.
void save_torch(const NamedTensors& tensors, const std::string& path);

/// Whether `path` starts as a zip does (torch.save's format; a
/// safetensors file starts with its header length).
bool is_torch_file(const std::string& path);

/// Reads a dict of tensors written by torch.save or save_torch. Throws
/// CheckpointError naming the file (and the key) when it is not one.
NamedTensors load_torch(const std::string& path);

}  // namespace cohort::dcp
