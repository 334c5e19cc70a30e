"""A Horovod-style epoch loop on uneven ranks (ASHL_EMULATE_COMPUTE) whose plan changes while
the ranks are in different epochs: rank 0 writes, for every epoch all ranks finished, the
indices each rank read, and the strategy's late-shares counts, to argv[1] (JSON)."""
import argparse
import json

from mpi4py import MPI
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ashl.torch as ashl
from ashl.data import digits
from ashl.models import build_model
from ashl.stages import StageConfig

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--strategy", default="ashl")
parser.add_argument("--max-seconds", type=float, default=8.0)
args = parser.parse_args()

hvd.init(comm=MPI.COMM_WORLD)
torch.manual_seed(0)
data = digits()
model = build_model("mlp", data.input_shape, data.classes)
sampler = ashl.HeterogeneousSampler(data.train)
opt = ashl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model=model,
                                sampler=sampler, strategy=args.strategy, profile_steps=5,
                                stage_config=StageConfig(max_seconds=args.max_seconds,
                                                         switch_loss=0.6))
ashl.broadcast_parameters(model.state_dict(), root_rank=0)

read = {}
epoch = 0
while not opt.finished:
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(DataLoader(data.train, batch_size=32, sampler=sampler)):
        if i == 0:
            read[epoch] = sampler.indices(epoch)   # the pass's indices, fixed when it began
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if opt.finished:
            break
    else:
        epoch += 1
        continue
    read.pop(epoch, None)          # cut short by the end: not a whole epoch
    break
late = opt.counters().get("late_shares", 0)
opt.finish()
everyone = MPI.COMM_WORLD.gather((read, late), root=0)
if hvd.rank() == 0:
    common = sorted(set.intersection(*(set(r) for r, _ in everyone)))
    epochs = {e: [r[e] for r, _ in everyone] for e in common}
    json.dump({"n": len(data.train), "epochs": epochs, "late": [l for _, l in everyone]},
              open(args.out, "w"))
