"""Horovod's resume recipe applied to ashl's checkpoint: `--save PATH` trains a few steps and
saves (every rank), `--resume PATH` loads on rank 0 only, as a Horovod script loads its
checkpoint before broadcasting it, then trains."""
import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import ashl.torch as ashl
from ashl.stages import StageConfig

parser = argparse.ArgumentParser()
parser.add_argument("--save", default=None)
parser.add_argument("--resume", default=None)
parser.add_argument("--strategy", default="ashl")
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size())
optimizer = ashl.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                      strategy=args.strategy,
                                      stage_config=StageConfig(max_commits=12))
if args.resume and hvd.rank() == 0:
    optimizer.load_checkpoint(args.resume)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

x = torch.randn(256, 8)
y = (x[:, 0] > 0).long()
while not optimizer.finished:
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
if args.save:
    optimizer.save_checkpoint(args.save)
