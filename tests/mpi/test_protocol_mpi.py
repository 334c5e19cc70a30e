"""The wire protocol between two real ranks under mpirun."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# --- real ranks -----------------------------------------------------------------------------

SCRIPT = Path(__file__).resolve().parent / "protocol_exchange.py"


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_two_ranks_commit_and_reply(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found")
    pytest.importorskip("mpi4py")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none",  # containers forbid CMA
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2] / "src"),
                                                        os.environ.get("PYTHONPATH")])))
    cmd = ["mpirun", "-np", "2", "--oversubscribe", sys.executable, str(SCRIPT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 0 OK" in out and "rank 1 OK" in out, out[-4000:]
