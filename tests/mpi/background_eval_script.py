"""A user's script in Horovod's example style that evaluates in the background with
ashl.BackgroundEvaluator: argparse, an epoch loop of a fixed length, DistributedSampler-like
shards, metrics averaged with hvd.allreduce, and no opt.finish() (ashl leaves the run at exit).
"""
import argparse
import json

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from mpi4py import MPI

import ashl.torch as ashl
from ashl.stages import StageConfig

p = argparse.ArgumentParser()
p.add_argument("--strategy", default="ashl")
p.add_argument("--epochs", type=int, default=12)
p.add_argument("--target", type=float, default=0.999)   # not met: the loop's end ends the run
p.add_argument("--out", required=True)
args = p.parse_args()

hvd.init(comm=MPI.COMM_WORLD)
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x = torch.randn(1024, 16, generator=g)
y = (x[:, :4].argmax(1)).long()                      # a learnable rule
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def test_accuracy(m):
    return float((m(x).argmax(1) == y).float().mean())


evaluate = ashl.BackgroundEvaluator(model, test_accuracy) if hvd.rank() == 0 else None
opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
opt = ashl.DistributedOptimizer(opt, model=model, strategy=args.strategy, evaluate=evaluate,
                                eval_every_s=0.0, named_parameters=model.named_parameters(),
                                stage_config=StageConfig(target_accuracy=args.target))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
shard = torch.arange(hvd.rank(), len(x), hvd.size())
for epoch in range(args.epochs):
    for i in range(0, len(shard), 32):
        b = shard[i:i + 32]
        opt.zero_grad()
        loss = F.cross_entropy(model(x[b]), y[b])
        loss.backward()
        opt.step()
    mean_loss = hvd.allreduce(loss.detach(), name="epoch_loss").item()
if hvd.rank() == 0:
    with open(args.out, "w") as f:
        json.dump({"evaluations": evaluate.evaluations, "loss": mean_loss,
                   "accuracy": opt.counters()["last_accuracy"]}, f)
