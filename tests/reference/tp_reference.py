"""PyTorch's own tensor parallelism (DTensor: parallelize_module with
ColwiseParallel and RowwiseParallel) as the reference peer for cohort's
tensor-parallel golden test.

Started by tests/reference/tp_golden_test.cpp as tp processes of one gloo
job on CPU (command line and files: golden_peer.py). The model is
Linear(width, hidden) column-parallel, Tanh, Linear(hidden, width)
row-parallel, with an MSE loss on the replicated output; each run trains for
--steps SGD steps.

--run NAME:CONTROL; CONTROL: none; weight (the row-parallel weight's first
element + 1e-3); lr (learning rate x 1.1).

Files in --dir (float32, raw):
  init_<i>.bin            parameter i: w1 [hidden, width], b1, w2 [width, hidden], b2
  x.bin, y.bin            the batch, [batch, width], the same on every rank
  <NAME>_losses_<r>.bin   written by rank r: the loss at each step
  <NAME>_param_<i>.bin    written by rank 0: parameter i after training, whole
"""
from golden_peer import main, read, write


def train(args, run, torch, dist):
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    name, control = run.split(":")
    w, h, rank = args.width, args.hidden, dist.get_rank()
    model = nn.Sequential(nn.Linear(w, h), nn.Tanh(), nn.Linear(h, w))
    shapes = [(h, w), (h,), (w, h), (w,)]
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(read(torch, f"{args.dir}/init_{i}.bin", shapes[i]))
        if control == "weight":
            model[2].weight[0, 0] += 1e-3
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    lr = args.lr * (1.1 if control == "lr" else 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    x = read(torch, f"{args.dir}/x.bin", (args.batch, w))
    y = read(torch, f"{args.dir}/y.bin", (args.batch, w))
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    write(f"{args.dir}/{name}_losses_{rank}.bin", torch.tensor(losses, dtype=torch.float32))
    for i, p in enumerate(model.parameters()):
        whole = p.full_tensor()  # collective: every rank takes part
        if rank == 0:
            write(f"{args.dir}/{name}_param_{i}.bin", whole)


if __name__ == "__main__":
    main(["torch.distributed.tensor.parallel", "torch.distributed.device_mesh"], train)
