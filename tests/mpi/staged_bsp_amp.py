"""Two ranks of strategy "bsp" with its gradients staged (ASHL_STAGE_WIRE=1: ashl averages
them, as for a CUDA model under a Horovod without GPU operations) and a GradScaler, by
RECIPE: "horovod" (synchronize, unscale_, step under skip_synchronize) or "plain"
(scaler.step alone). Rank 1's own gradient overflows in its backward on step 1. Rank 0
writes every rank's models after each step, scales, counters and local ranks to OUT.

    mpirun -np 2 python staged_bsp_amp.py RECIPE OUT
"""
import json
import sys

import torch

import ashl.torch as ashl
import horovod.torch as hvd
from mpi4py import MPI

from ashl.device import host_rank, local_rank
from ashl.stages import StageConfig

def train_with_scaler(opt, model, x, y, recipe: str, overflow_on_step_1: bool):
    """The user's loop with a GradScaler until the run ends: (the model after each step,
    the scale after each step). With `overflow_on_step_1`, this rank's own gradient
    overflows in its backward on step 1 (fp16's inf)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    after, scales, step = [], [], 0
    while not opt.finished:
        i = (step * 8) % 64
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8])
        hook = (model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
                if step == 1 and overflow_on_step_1 else None)
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        if recipe == "horovod":
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        scales.append(scaler.get_scale())
        step += 1
    return after, scales


def main():
    recipe, out = sys.argv[1], sys.argv[2]
    hvd.init(comm=MPI.COMM_WORLD)
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(64, 4, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    opt = ashl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                    strategy="bsp", stage_config=StageConfig(max_commits=2 * 4))
    after, scales = train_with_scaler(opt, model, x, y, recipe, overflow_on_step_1=rank == 1)
    opt.finish()
    counters = opt.counters()
    mine = {"after": [a.tolist() for a in after], "scales": scales,
            "local_steps": counters["local_steps"], "staging": counters["staging"],
            "horovod_optimizer": counters["horovod_optimizer"],
            "local_rank": local_rank(), "host_rank": host_rank(MPI.COMM_WORLD)}
    ranks = MPI.COMM_WORLD.gather(mine, root=0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(ranks, f)


if __name__ == "__main__":
    main()
