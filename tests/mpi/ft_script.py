"""A user's fault-tolerant training script, in Horovod's example style (argparse, an epoch
loop over a sampler, the wrapped optimizer with Horovod's keywords), for the fault tests.

    python -m ashl.run mpirun -np 4 --enable-recovery python ft_script.py OUT_DIR
        [--die-in-send RANK --at-commit N]

A fault-tolerant run does not call Horovod collectives once training has begun (a lost rank
would hang an ``hvd.allreduce`` of the metrics): rank 0 evaluates through ``evaluate=`` and
every survivor writes its own result. ``--die-in-send`` makes RANK kill itself with SIGKILL
in the middle of sending its commit N: the header and part of the payload handed to ZeroMQ,
the rest never.
"""
import argparse
import json
import os
import signal
from pathlib import Path

from mpi4py import MPI
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ashl.torch as ashl
from ashl.data import digits
from ashl.models import build_model
from ashl.stages import StageConfig

parser = argparse.ArgumentParser(description="ashl fault-tolerant digits example")
parser.add_argument("out", type=Path)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--target-accuracy", type=float, default=0.95)
parser.add_argument("--max-seconds", type=float, default=90)
parser.add_argument("--die-in-send", type=int, default=-1, metavar="RANK")
parser.add_argument("--at-commit", type=int, default=10)
parser.add_argument("--die-at-step", type=int, default=-1, metavar="RANK",
                    help="this rank kills itself at its 3rd step, while profiling")
parser.add_argument("--startup-timeout", type=float, default=None)
parser.add_argument("--strategy", default="ashl")
parser.add_argument("--transport", default="zmq")
args = parser.parse_args()

hvd.init(comm=MPI.COMM_WORLD)
torch.manual_seed(0)
torch.set_num_threads(1)
data = digits()
model = build_model("mlp", data.input_shape, data.classes)
test_x, test_y = data.test.tensors


def accuracy() -> float:
    with torch.no_grad():
        return (model(test_x).argmax(1) == test_y).float().mean().item()


sampler = ashl.HeterogeneousSampler(data.train, num_replicas=hvd.size(), rank=hvd.rank())
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
optimizer = ashl.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=1,
    model=model, sampler=sampler, strategy=args.strategy, transport=args.transport,
    fault_tolerant=True, evaluate=accuracy, eval_every_s=0.2,
    startup_timeout_s=args.startup_timeout,
    stage_config=StageConfig(target_accuracy=args.target_accuracy, max_seconds=args.max_seconds))
ashl.broadcast_parameters(model.state_dict(), root_rank=0)


def die_in_the_middle_of_a_send(end):
    """The rank end's send, but the process is killed once part of the message is out."""
    import zmq
    from ashl import protocol

    def send(header, payload=None, cancelled=None):
        body = protocol._as_bytes(payload)
        end.sock.send(protocol.encode(header), zmq.SNDMORE)
        end.sock.send(body[:body.size // 2], zmq.SNDMORE, copy=True)
        print(f"rank {hvd.rank()}: killed in the middle of commit {header.commit}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return send


epoch = 0
while not optimizer.finished:
    sampler.set_epoch(epoch)
    for data_batch, target in DataLoader(data.train, batch_size=args.batch_size, sampler=sampler):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data_batch), target)
        loss.backward()
        optimizer.step(loss=loss)
        if hvd.rank() == args.die_at_step and optimizer.counters()["local_steps"] == 3:
            print(f"rank {hvd.rank()}: killed while profiling", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if (hvd.rank() == args.die_in_send
                and optimizer.counters()["commits"] + 1 >= args.at_commit):
            end = optimizer.strategy.client.end
            end.send = die_in_the_middle_of_a_send(end)
        if optimizer.finished:
            break
    epoch += 1
optimizer.finish()
result = {"rank": hvd.rank(), "accuracy": accuracy(), "counters": optimizer.counters(),
          "lost_ranks": optimizer.strategy.lost_ranks, "stop_reason": optimizer.strategy.stop_reason}
(args.out / f"rank{hvd.rank()}.json").write_text(json.dumps(result, default=str))
