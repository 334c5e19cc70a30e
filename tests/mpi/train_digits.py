"""A user's training script, as in the README: digits, an MLP, ashl.torch.DistributedOptimizer.

python train_digits.py OUT.json [--strategy ashl] [--target-accuracy 0.9] [--max-seconds 60]
"""
import argparse
import faulthandler
import json
import sys
import time

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
parser.add_argument("--target-accuracy", type=float, default=0.9)
parser.add_argument("--max-seconds", type=float, default=60)
parser.add_argument("--switch-loss", type=float, default=0.3)
parser.add_argument("--ahl-max-commits", type=int, default=None)
parser.add_argument("--topk", type=float, default=None, help="force this SHL top-k ratio")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--max-commits", type=int, default=None)
parser.add_argument("--checkpoint", default=None, help="save here after every epoch")
parser.add_argument("--resume", default=None, help="continue the run saved here")
parser.add_argument("--ranks", type=int, default=None, help="ranks of the run (shares)")
parser.add_argument("--dump-after", type=float, default=150,
                    help="print every thread's stack and exit after this many seconds (a hang)")
args = parser.parse_args()
faulthandler.dump_traceback_later(args.dump_after, exit=True, file=sys.stderr)

hvd.init(comm=MPI.COMM_WORLD)
torch.manual_seed(args.seed)
torch.set_num_threads(1)
data = digits()
model = build_model("mlp", data.input_shape, data.classes)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sampler = ashl.HeterogeneousSampler(data.train, seed=args.seed)
test_x, test_y = data.test.tensors


def accuracy() -> float:
    with torch.no_grad():
        model.eval()
        acc = (model(test_x).argmax(1) == test_y).float().mean().item()
        model.train()
    return acc


stages = StageConfig(switch_loss=args.switch_loss, target_accuracy=args.target_accuracy,
                     max_seconds=args.max_seconds, ahl_max_commits=args.ahl_max_commits,
                     max_commits=args.max_commits)
compression = ashl.Compression.topk(args.topk) if args.topk else None
opt = ashl.DistributedOptimizer(opt, model=model, sampler=sampler, strategy=args.strategy,
                                compression=compression, stage_config=stages,
                                evaluate=accuracy, eval_every_s=0.5, profile_steps=5)
ashl.broadcast_parameters(model.state_dict(), root_rank=0)
if args.resume:
    opt.load_checkpoint(args.resume)
resumed_accuracy = accuracy()
start = time.time()
epoch = 0
stages_seen = []
while not opt.finished:
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data.train, batch_size=32, sampler=sampler):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(loss=loss)
        if not stages_seen or stages_seen[-1] != opt.stage:
            stages_seen.append(opt.stage)
        if opt.finished:
            break
    epoch += 1
    if args.checkpoint and not opt.finished:
        opt.save_checkpoint(args.checkpoint)
opt.finish()
final = accuracy()
result = {"rank": hvd.rank(), "accuracy": final, "stages": stages_seen,
          "resumed_accuracy": resumed_accuracy,
          "seconds": time.time() - start, "counters": opt.counters(),
          "plan": opt.plan.to_dict() if opt.plan else None,
          # ashl-sync: every rank's own stage machine (identical on all ranks)
          "transitions": getattr(opt.strategy, "transitions", None)}
results = MPI.COMM_WORLD.gather(result, root=0)
if hvd.rank() == 0:
    events = [e.to_dict() for e in opt.strategy.mc.events()] if hasattr(opt.strategy, "mc") else []
    json.dump({"ranks": results, "events": events}, open(args.out, "w"), indent=1, default=str)
