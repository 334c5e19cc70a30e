"""ashl.broadcast_parameters without Horovod (a parameter-server strategy needs none): the
same broadcast over mpi4py's world, every dtype of a state_dict."""
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
print("same on", len(rows), "ranks")
"""

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")]


def test_the_mpi_broadcast_gives_every_rank_rank_0s_state(tmp_path):
    script = tmp_path / "bcast.py"
    script.write_text(SCRIPT)
    proc = _util.mpirun(3, script, timeout=60)
    assert "same on 3 ranks" in proc.stdout
