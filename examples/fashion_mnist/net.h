// defines: Net, the CNN of the PyTorch MNIST example (without dropout):
// conv1(1,32,3) relu conv2(32,64,3) relu maxpool2 flatten fc1(9216,128)
// relu fc2(128,10). tests/reference/fashion_mnist_reference.py is the same.
// make_sequential_net() is the same network as a Sequential.
#pragma once

#include <torch/torch.h>

namespace fashion_mnist {

struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(1, 32, 3))),
        conv2(register_module("conv2", torch::nn::Conv2d(32, 64, 3))),
        fc1(register_module("fc1", torch::nn::Linear(9216, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv1(x));
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = torch::relu(fc1(x.flatten(1)));
    return fc2(x);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

/// Net's layers as a Sequential (the same layers built in the same order, so
/// the same seed gives the same weights), whose layers fully_shard can make
/// units of their own (fashion_mnist --fsdp).
inline torch::nn::Sequential make_sequential_net() {
  // One statement per layer: the order in which a call's arguments are
  // evaluated (and so the weights drawn) is unspecified.
  torch::nn::Conv2d conv1(1, 32, 3);
  torch::nn::Conv2d conv2(32, 64, 3);
  torch::nn::Linear fc1(9216, 128);
  torch::nn::Linear fc2(128, 10);
  return torch::nn::Sequential(conv1, torch::nn::ReLU(), conv2, torch::nn::ReLU(),
                               torch::nn::MaxPool2d(2), torch::nn::Flatten(), fc1,
                               torch::nn::ReLU(), fc2);
}

}  // namespace fashion_mnist
