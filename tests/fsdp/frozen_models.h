// defines: the layers the frozen-parameter tests build their models from:
// frozen(), Stack (layers in order, a unit or plain), a block that reads a
// tensor its parent hands it beside its input (cross-attention's encoder
// output), and a module that calls its inner module twice.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace cohort::testing::fsdp_test {

using torch::nn::AnyModule;
using torch::nn::Linear;

// `m` with every parameter frozen.
template <class M>
M frozen(M m) {
  for (auto& p : m->parameters()) p.set_requires_grad(false);
  return m;
}

// Layers in order, named "0", "1", ... as in a Sequential (which an
// AnyModule cannot hold, so one cannot sit in another plainly).
struct StackImpl : torch::nn::Module {
  std::vector<AnyModule> layers;
  template <class M>
  void add(M m) {
    layers.emplace_back(register_module(std::to_string(layers.size()), m));
  }
  void add(AnyModule m) {
    register_module(std::to_string(layers.size()), m.ptr());
    layers.push_back(std::move(m));
  }
  void push_back(AnyModule m) { add(std::move(m)); }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = l.forward<torch::Tensor>(x);
    return x;
  }
};
TORCH_MODULE(Stack);

// Where a parent leaves a tensor for a block to read during the block's
// forward (a member or a closure in a user's model).
using Slot = std::shared_ptr<torch::Tensor>;

// A block whose frozen layer reads the slot's tensor, not its input:
// trainable(x) + frozen part of the slot. The frozen part is computed first,
// so its backward (the slot's gradient, from the frozen weight) comes after
// the trainable layer's gradients landed. `scale`: the frozen part is
// (slot * scale).sum(1) with a frozen [3] scale, a weight its backward reads
// as it is (not through a view); else a frozen Linear(6, 5) of the slot.
struct SideReaderImpl : torch::nn::Module {
  SideReaderImpl(Slot slot, bool scale) : slot(std::move(slot)) {
    if (scale) {
      this->scale = register_parameter("scale", torch::ones({3}));
      this->scale.set_requires_grad(false);
    } else {
      proj = register_module("proj", frozen(Linear(6, 5)));
    }
    out = register_module("out", Linear(5, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto side = proj ? proj(*slot) : (*slot * scale).sum(1, /*keepdim=*/true);
    return out(x) + side;
  }
  Slot slot;
  torch::Tensor scale;
  Linear proj{nullptr}, out{nullptr};
};
TORCH_MODULE(SideReader);

// enc(x) left in the slot for `block`, which gets x itself (data: no
// gradient), as a decoder block gets the encoder's output.
struct SideInputImpl : torch::nn::Module {
  SideInputImpl(Linear enc, AnyModule block, Slot slot) : block(std::move(block)), slot(slot) {
    this->enc = register_module("enc", enc);
    register_module("block", this->block.ptr());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    *slot = enc(x);
    auto y = block.forward<torch::Tensor>(x);
    *slot = torch::Tensor();
    return y;
  }
  Linear enc{nullptr};
  AnyModule block;
  Slot slot;
};
TORCH_MODULE(SideInput);

// inner(inner(x)): one module called twice in a forward.
struct TwiceImpl : torch::nn::Module {
  explicit TwiceImpl(AnyModule inner) : inner(std::move(inner)) {
    register_module("inner", this->inner.ptr());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return inner.forward<torch::Tensor>(inner.forward<torch::Tensor>(x));
  }
  AnyModule inner;
};
TORCH_MODULE(Twice);

}  // namespace cohort::testing::fsdp_test
