#!/usr/bin/python3
"""Single-process PyTorch reference for examples/fashion_mnist.

Trains the same CNN (conv1(1,32,3) relu conv2(32,64,3) relu maxpool2
flatten fc1(9216,128) relu fc2(128,10)) with AdamW lr 1e-3, batch 128, on
Debian's dataset-fashion-mnist files, and prints the test accuracy in the
same "test accuracy: 0.XXXX" form as the C++ example.

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/reference/fashion_mnist_reference.py --epochs 2
"""
import argparse
import gzip
import os
import struct
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel statistics


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(folder, split):
    images = read_idx(os.path.join(folder, f"{split}-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(folder, f"{split}-labels-idx1-ubyte.gz"))
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    return (x - MEAN) / STD, torch.from_numpy(labels.astype(np.int64))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_x, train_y = load(args.data, "train")
    test_x, test_y = load(args.data, "t10k")
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    for epoch in range(args.epochs):
        start = time.time()
        model.train()
        order = torch.randperm(len(train_x))
        # Full batches only, as the C++ trainer (drop_last).
        for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = order[i:i + args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
            loss.backward()
            opt.step()
        print(f"epoch {epoch + 1}: {time.time() - start:.1f} s, last loss {loss.item():.4f}",
              flush=True)
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(test_x), 1000):
            correct += (model(test_x[i:i + 1000]).argmax(1) == test_y[i:i + 1000]).sum().item()
    print(f"test accuracy: {correct / len(test_x):.4f}")


if __name__ == "__main__":
    main()
