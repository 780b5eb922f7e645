"""PyTorch's own torch.utils.data.DistributedSampler as the reference for
cohort::data::DistributedSampler (tests/data/sampler_test.cpp).

Reads cases from stdin, one a line: "size world shuffle drop_last seed
epochs" (shuffle and drop_last 0 or 1). Writes, for each case, epoch and
rank, one line: "size world shuffle drop_last seed epoch rank: i i i ...",
the indices PyTorch's sampler yields after set_epoch(epoch).
"""
import sys

from torch.utils.data import DistributedSampler

for line in sys.stdin:
    if not line.strip():
        continue
    size, world, shuffle, drop_last, seed, epochs = (int(v) for v in line.split())
    for epoch in range(epochs):
        for rank in range(world):
            sampler = DistributedSampler(range(size), num_replicas=world, rank=rank,
                                         shuffle=bool(shuffle), seed=seed,
                                         drop_last=bool(drop_last))
            sampler.set_epoch(epoch)
            got = " ".join(str(i) for i in sampler)
            print(f"{size} {world} {shuffle} {drop_last} {seed} {epoch} {rank}: {got}")
