"""Train an MLP on the embedded digits data with ashl.torch.DistributedOptimizer.

    horovodrun -np 4 python examples/train_digits.py out/digits.json
    mpirun -np 4 --oversubscribe --bind-to none python examples/train_digits.py out/digits.json

Options: --strategy (ashl, ashl-sync, bsp, localsgd, ssp, asp, adsp), --target-accuracy, --max-seconds, --max-commits,
--compression (none, fp16, topk:RATIO), --checkpoint PATH (saved every epoch), --resume PATH. Rank 0 prints a summary and writes
every rank's result, the plan and the coordinator's log to the JSON file.
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
parser.add_argument("--compression", default=None,
                    help="force a compressor for every commit: none, fp16 or topk:RATIO")
parser.add_argument("--outer-optimizer", default=None,
                    help="e.g. nesterov(0.7, 0.9); default: the strategy's own")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="parameter-server strategies: keep stepping while a commit travels "
                         "(default: the strategy's, on for ashl)")
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
if args.compression is None:
    compression = None                      # the plan's: dense in AHL, top-k in SHL
elif args.compression.startswith("topk:"):
    compression = ashl.Compression.topk(float(args.compression[5:]))
else:
    compression = getattr(ashl.Compression, args.compression)
opt = ashl.DistributedOptimizer(opt, model=model, sampler=sampler, strategy=args.strategy,
                                compression=compression, stage_config=stages,
                                evaluate=accuracy, eval_every_s=0.5, profile_steps=5,
                                outer_optimizer=args.outer_optimizer,
                                **({} if args.overlap is None else {"overlap": args.overlap}))
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
if stages_seen[-1:] != [opt.stage]:    # the run can also end between steps (an epoch join)
    stages_seen.append(opt.stage)
opt.finish()
final = accuracy()
result = {"rank": hvd.rank(), "accuracy": final, "stages": stages_seen,
          "resumed_accuracy": resumed_accuracy,
          "seconds": time.time() - start, "counters": opt.counters(),
          "plan": opt.plan.to_dict() if opt.plan else None,
          # the stage changes, where this rank sees the stage machine
          "transitions": opt.strategy.transitions}
results = MPI.COMM_WORLD.gather(result, root=0)
if hvd.rank() == 0:
    events = opt.strategy.transitions
    json.dump({"ranks": results, "events": events}, open(args.out, "w"), indent=1, default=str)
    print(f"{args.strategy}: {len(results)} ranks, test accuracy {final:.4f} after "
          f"{result['seconds']:.1f} s, stages {' -> '.join(stages_seen)}")
    if opt.plan is not None:
        for stage in ("AHL", "SHL"):
            p = opt.plan.stage(stage)
            print(f"  {stage}: local steps per rank {list(p.local_steps)}, "
                  f"top-k ratios {[round(r, 3) for r in p.ratios]}")
    for r in results:
        c = r["counters"]
        print(f"  rank {r['rank']}: {c['local_steps']} local steps, {c['commits']} commits, "
              f"compute {c['compute_s']:.2f} s, communication {c['comm_s']:.2f} s")
    for e in events:
        print(f"  [{e['at_s']:7.2f} s] {e['from']} -> {e['to']}: {e['reason']}")
    print(f"  details: {args.out}")
