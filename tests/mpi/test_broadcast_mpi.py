"""ashl.broadcast_parameters without Horovod (a parameter-server strategy needs none): the
same broadcast over mpi4py's world, every dtype of a state_dict. broadcast_optimizer_state
the same way, and through host memory under a Horovod that cannot take the tensors (a GPU
model's, a Horovod without GPU operations: forced here on CPU tensors)."""
import pytest

import _util

SCRIPT = """import sys, torch
import ashl.torch as ashl
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
torch.manual_seed(rank)        # every rank its own model
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
model[1].num_batches_tracked.fill_(7 if rank == 0 else 0)
model.half()                   # fp16 parameters and buffers, and an int64 counter
ashl.broadcast_parameters(model.state_dict(), root_rank=0)
flat = torch.cat([t.detach().reshape(-1).float() for t in model.state_dict().values()])
rows = MPI.COMM_WORLD.allgather(flat.tolist())
assert all(r == rows[0] for r in rows), rows
assert int(model[1].num_batches_tracked) == 7
assert "horovod.torch" not in sys.modules
plain = torch.nn.Linear(3, 4)   # model.parameters(), no names: Horovod takes those too
ashl.broadcast_parameters(list(plain.parameters()), root_rank=0)
flat = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
assert all(r == flat.tolist() for r in MPI.COMM_WORLD.allgather(flat.tolist()))
if rank == 0:              # one line: unbuffered ranks' words would interleave
    print(f"same on {len(rows)} ranks")
"""

OPTIMIZER_SCRIPT = """import sys, torch
import ashl.torch as ashl
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
if sys.argv[1] == "horovod":
    import horovod.torch as hvd
    import ashl.strategies.runtime as runtime
    hvd.init(comm=comm)
    runtime.horovod_reduces_on = lambda hvd, device, strategy: False   # "no GPU operations"
torch.manual_seed(rank)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
opt = torch.optim.Adam(model.parameters(), lr=0.1 * (rank + 1), betas=(0.8, 0.9))
if rank == 0:              # the root's state: two real steps; the others' is empty
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
ashl.broadcast_optimizer_state(opt, root_rank=0)
state = [[v.reshape(-1).tolist() for _, v in sorted(s.items())] for s in opt.state.values()]
rows = comm.allgather((state, opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
assert all(r == rows[0] for r in rows), rows
assert rows[0][1] == 0.1 and rows[0][2] == (0.8, 0.9)
assert all(int(s["step"]) == 2 for s in opt.state.values())
assert ("horovod.torch" in sys.modules) == (sys.argv[1] == "horovod")
if rank == 0:              # one line: unbuffered ranks' words would interleave
    print(f"same state on {len(rows)} ranks")
"""

# Horovod's resume recipe (its ImageNet example) on an ashl optimizer: rank 0 alone loads the
# checkpoint's optimizer state, then hvd.broadcast_optimizer_state, whose empty-state step
# must be the torch optimizer's own (a strategy's step would start the run, or wait in a
# collective the root never joins), then training.
RESUME_SCRIPT = """import sys, torch
import horovod.torch as hvd
import ashl.torch as ashl
from mpi4py import MPI
from ashl.stages import StageConfig
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
saved = torch.optim.Adam(model.parameters(), lr=0.01)
for _ in range(2):
    saved.zero_grad()
    model(torch.randn(5, 3)).square().sum().backward()
    saved.step()
checkpoint = saved.state_dict()
torch.manual_seed(1)
model = torch.nn.Linear(3, 2)
opt = ashl.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                named_parameters=model.named_parameters(), strategy=sys.argv[1],
                                stage_config=StageConfig(max_commits=4))
if hvd.rank() == 0:
    opt.load_state_dict(checkpoint)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
assert opt.counters()["local_steps"] == 0, opt.counters()
state = [[v.reshape(-1).tolist() for _, v in sorted(s.items())] for s in opt.state.values()]
rows = MPI.COMM_WORLD.allgather(state)
assert all(r == rows[0] for r in rows) and len(rows[0]) == 2, rows
while not opt.finished:
    opt.zero_grad()
    model(torch.randn(5, 3)).square().sum().backward()
    opt.step()
if hvd.rank() == 0:
    print(f"resumed on {hvd.size()} ranks, {opt.counters()['local_steps']} steps")
"""

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")]


def test_the_mpi_broadcast_gives_every_rank_rank_0s_state(tmp_path):
    script = tmp_path / "bcast.py"
    script.write_text(SCRIPT)
    proc = _util.mpirun(3, script, timeout=60)
    assert "same on 3 ranks" in proc.stdout


@pytest.mark.parametrize("horovod", ["none", "horovod"])
def test_optimizer_state_reaches_every_rank_through_host_memory(tmp_path, horovod):
    script = tmp_path / "bcast_opt.py"
    script.write_text(OPTIMIZER_SCRIPT)
    proc = _util.mpirun(2, script, horovod, timeout=90)
    assert "same state on 2 ranks" in proc.stdout


@pytest.mark.parametrize("strategy", ["localsgd", "ashl"])
def test_horovods_broadcast_optimizer_state_takes_the_torch_step(tmp_path, strategy):
    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    proc = _util.mpirun(2, script, strategy, timeout=90)
    assert "resumed on 2 ranks" in proc.stdout, proc.stdout + proc.stderr[-3000:]
