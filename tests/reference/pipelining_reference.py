"""PyTorch's own pipeline schedules (torch.distributed.pipelining) as the
reference peer for cohort's pipeline golden test.

Started by tests/reference/pipelining_golden_test.cpp as pp processes of one
gloo job on CPU (command line and files: golden_peer.py). The model is
`stages` blocks of (Linear(width, width), Tanh), stage s holding block s;
stage s runs on rank s % pp, as in cohort. Each run trains for --steps SGD
steps.

--run NAME:SCHEDULE:V:M:CONTROL; SCHEDULE is gpipe, 1f1b or interleaved, V
stages per rank, M micro-batches. CONTROL: none; weight (parameter 0's
first element + 1e-3); sum (PyTorch's own loss convention: micro-batch
losses summed, not averaged); lr (learning rate x 1.1).

Gradient convention: cohort backpropagates each micro-batch's mean loss / m
(the whole batch's mean loss); PyTorch 2.6 backpropagates what loss_fn
returns, so loss_fn returns mse / m, and the losses written are x m again.
PyTorch 2.14's schedules divide the gradients by m themselves unless told
scale_grads=False, which they are told here (loss_fn already divides).

Files in --dir (float32, raw):
  init_<i>.bin               parameter i (stage i // 2: weight, bias)
  x.bin, y.bin               the batch, [batch, width]
  <NAME>_losses.bin          written by the last stage's rank: [steps, m]
  <NAME>_param_<i>.bin       written by parameter i's rank after training
"""
import inspect

from golden_peer import main, read, write


class _AllWorks:
    """The works of one batch_isend_irecv, waited together."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True


def wait_every_p2p(torch, dist):
    """PyTorch 2.6's _batch_p2p returns only the last of batch_isend_irecv's
    works, one per operation under Gloo, so 1F1B waits for one receive of a
    pair and deadlocks (pytorch/pytorch#132644; fixed upstream by #152938,
    whose behaviour this restores: every work is waited)."""
    from torch.distributed.pipelining import schedules

    if hasattr(schedules, "_wait_batch_p2p"):
        return  # a PyTorch with the fix (2.14 has it), which waits on a list

    def batch_p2p(p2p_ops, desc=None):
        if len(p2p_ops) == 0:
            return None
        return _AllWorks(dist.batch_isend_irecv(p2p_ops))

    schedules._batch_p2p = batch_p2p


def train(args, run, torch, dist):
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed import pipelining as pl

    name, schedule, v, m, control = run.split(":")
    v, m = int(v), int(m)
    rank, pp = dist.get_rank(), dist.get_world_size()
    stages, w = pp * v, args.width
    mine = [s for s in range(stages) if s % pp == rank]
    modules = {}
    for s in mine:
        lin = nn.Linear(w, w)
        with torch.no_grad():
            lin.weight.copy_(read(torch, f"{args.dir}/init_{2 * s}.bin", (w, w)))
            lin.bias.copy_(read(torch, f"{args.dir}/init_{2 * s + 1}.bin", (w,)))
            if control == "weight" and s == 0:
                lin.weight[0, 0] += 1e-3
        modules[s] = nn.Sequential(lin, nn.Tanh())
    pipe = [pl.PipelineStage(modules[s], s, stages, torch.device("cpu")) for s in mine]
    scale = 1.0 if control == "sum" else 1.0 / m

    def loss_fn(out, target):
        return F.mse_loss(out, target) * scale

    def make(kind, stages_arg):
        extra = {}
        if "scale_grads" in inspect.signature(kind.__init__).parameters:
            extra["scale_grads"] = False
        return kind(stages_arg, m, loss_fn=loss_fn, **extra)

    if schedule == "interleaved":
        sched = make(pl.ScheduleInterleaved1F1B, pipe)
    else:
        assert v == 1, run
        kinds = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B}
        sched = make(kinds[schedule], pipe[0])
    params = [p for s in mine for p in modules[s].parameters()]
    opt = torch.optim.SGD(params, lr=args.lr * (1.1 if control == "lr" else 1.0))
    x = read(torch, f"{args.dir}/x.bin", (args.batch, w))
    y = read(torch, f"{args.dir}/y.bin", (args.batch, w))
    has_last = stages - 1 in mine
    all_losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        losses = []
        inputs = (x,) if 0 in mine else ()
        sched.step(*inputs, target=y if has_last else None, losses=losses)
        opt.step()
        all_losses.append([float(l) / scale for l in losses])
    if has_last:
        write(f"{args.dir}/{name}_losses.bin", torch.tensor(all_losses, dtype=torch.float32))
    for s in mine:
        for k, p in enumerate(modules[s].parameters()):
            write(f"{args.dir}/{name}_param_{2 * s + k}.bin", p)


if __name__ == "__main__":
    main(["torch.distributed.pipelining"], train, setup=wait_every_p2p)
