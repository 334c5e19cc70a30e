"""A Horovod-style script whose options depend on the rank, as a script may by mistake
(`strategy="ashl" if hvd.rank() == 0 else "localsgd"`): `--rank1-*` gives rank 1 its own
value, `--rank0-*` rank 0."""
import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ashl.torch as ashl
from ashl.stages import StageConfig

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--strategy", default="ashl")
parser.add_argument("--staleness", type=int, default=3)
parser.add_argument("--rank1-strategy", default=None)
parser.add_argument("--rank1-overlap", choices=["on", "off"], default=None)
parser.add_argument("--rank0-fault-tolerant", action="store_true")
parser.add_argument("--rank1-global-model-on", default=None)
parser.add_argument("--rank1-backward-passes-per-step", type=int, default=None)
args = parser.parse_args()

hvd.init()
torch.manual_seed(0)
x = torch.randn(256, 8)
dataset = TensorDataset(x, (x[:, 0] > 0).long())
sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
loader = DataLoader(dataset, batch_size=16, sampler=sampler)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

options = {"strategy": args.strategy, "staleness": args.staleness}
if hvd.rank() == 0 and args.rank0_fault_tolerant:
    options["fault_tolerant"] = True
if hvd.rank() == 1:
    if args.rank1_strategy is not None:
        options["strategy"] = args.rank1_strategy
    if args.rank1_overlap is not None:
        options["overlap"] = args.rank1_overlap == "on"
    if args.rank1_global_model_on is not None:
        options["global_model_on"] = args.rank1_global_model_on
    if args.rank1_backward_passes_per_step is not None:
        options["backward_passes_per_step"] = args.rank1_backward_passes_per_step
optimizer = ashl.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                      stage_config=StageConfig(max_commits=8), **options)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for data, target in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    loss = hvd.allreduce(loss.detach(), name="loss")
    if hvd.rank() == 0:
        print(f"epoch {epoch}: loss {loss.item():.3f}", flush=True)
