"""A small ashl run on digits with injected faults, for the reliability tests.

python fault_run.py OUT.json [--nan-rank R --nan-at-commit N] [--kill-rank R --kill-at-commit N
    --kill-in-stage AHL|SHL] [--mismatch-rank R] [--checkpoint PATH] [--resume PATH]
"""
import argparse
import json
import math
import os
import signal

from mpi4py import MPI
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ashl.torch as ashl
from ashl.data import digits
from ashl.models import MLP
from ashl.stages import StageConfig

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--target-accuracy", type=float, default=0.92)
p.add_argument("--max-seconds", type=float, default=60)
p.add_argument("--ahl-max-commits", type=int, default=None)
p.add_argument("--nan-rank", type=int, default=-1)
p.add_argument("--nan-at-commit", type=int, default=3)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--kill-at-commit", type=int, default=5)
p.add_argument("--kill-in-stage", default="AHL")
p.add_argument("--mismatch-rank", type=int, default=-1)
p.add_argument("--checkpoint", default=None)
p.add_argument("--resume", default=None)
args = p.parse_args()

hvd.init(comm=MPI.COMM_WORLD)
rank = hvd.rank()
torch.manual_seed(0)
torch.set_num_threads(1)
data = digits()
model = MLP(data.input_shape, data.classes,
            hidden=(128, 48) if rank == args.mismatch_rank else (128, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = ashl.HeterogeneousSampler(data.train)
test_x, test_y = data.test.tensors


def accuracy():
    with torch.no_grad():
        return (model(test_x).argmax(1) == test_y).float().mean().item()


opt = ashl.DistributedOptimizer(
    opt, model=model, sampler=sampler, profile_steps=5, evaluate=accuracy, eval_every_s=0.3,
    stage_config=StageConfig(target_accuracy=args.target_accuracy, max_seconds=args.max_seconds,
                             ahl_max_commits=args.ahl_max_commits))
ashl.broadcast_parameters(model.state_dict(), root_rank=0)
if args.resume:
    opt.load_checkpoint(args.resume)
resumed_accuracy = accuracy()
poisoned = False
epoch = 0
while not opt.finished:
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data.train, batch_size=32, sampler=sampler):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(loss=loss)
        commits = opt.counters()["commits"]
        if rank == args.nan_rank and not poisoned and commits >= args.nan_at_commit:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = math.nan  # the next delta holds NaN
            poisoned = True
        if (rank == args.kill_rank and commits >= args.kill_at_commit
                and opt.stage == args.kill_in_stage and (not args.checkpoint or epoch >= 1)):
            # (after the first epoch's checkpoint, so there is one to resume from)
            print(f"rank {rank}: killing myself in {opt.stage} after {commits} commits", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if opt.finished:
            break
    epoch += 1
    if args.checkpoint and not opt.finished:
        opt.save_checkpoint(args.checkpoint)
opt.finish()
result = {"rank": rank, "accuracy": accuracy(), "resumed_accuracy": resumed_accuracy,
          "counters": opt.counters(), "stage": opt.stage}
results = MPI.COMM_WORLD.gather(result, root=0)
if rank == 0:
    json.dump({"ranks": results}, open(args.out, "w"), default=str)
