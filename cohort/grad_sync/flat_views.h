// defines: flat_views, flat_aliases, flatten_into: the one builder of flat
// buffers whose pieces are per-tensor views, shared by DDP (gradient
// buckets), ZeRO (the flat parameters) and the fused optimizer (parameter
// and gradient buckets).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace cohort {

/// Views of `flat` at `offsets[i]`, shaped like `like[i]` (narrow + view:
/// autograd knows they are views).
inline std::vector<torch::Tensor> flat_views(const torch::Tensor& flat,
                                             const std::vector<torch::Tensor>& like,
                                             const std::vector<int64_t>& offsets) {
  std::vector<torch::Tensor> out;
  out.reserve(like.size());
  for (size_t i = 0; i < like.size(); ++i) {
    out.push_back(flat.narrow(0, offsets[i], like[i].numel()).view(like[i].sizes()));
  }
  return out;
}

/// The same pieces as aliases autograd does not track as views (set_ on the
/// storage): LibTorch's Optimizer::zero_grad() calls detach_() on every
/// .grad, which refuses views, so a .grad that lives in a bucket must be
/// such an alias.
inline std::vector<torch::Tensor> flat_aliases(const torch::Tensor& flat,
                                               const std::vector<torch::Tensor>& like,
                                               const std::vector<int64_t>& offsets) {
  std::vector<torch::Tensor> out;
  out.reserve(like.size());
  for (size_t i = 0; i < like.size(); ++i) {
    auto alias = torch::empty({0}, flat.options());
    alias.set_(flat.storage(), flat.storage_offset() + offsets[i], like[i].sizes());
    out.push_back(alias);
  }
  return out;
}

/// Copies each parameter into a new zeroed flat buffer of `numel` elements
/// at `offsets[i]` and makes the parameter a view into it (set_data keeps
/// the parameter's identity, hooks and optimizer references). Returns the
/// buffer. Call under torch::NoGradGuard.
inline torch::Tensor flatten_into(std::vector<torch::Tensor>& params,
                                  const std::vector<int64_t>& offsets, int64_t numel) {
  auto flat = torch::zeros({numel}, params.at(0).options().requires_grad(false));
  auto views = flat_views(flat, params, offsets);
  for (size_t i = 0; i < params.size(); ++i) {
    views[i].copy_(params[i]);
    params[i].set_data(views[i]);
  }
  return flat;
}

}  // namespace cohort
