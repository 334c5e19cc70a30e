"""The installation itself: the native module, Horovod's build, MPI beside Horovod."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_native_module_imports():
    import ashl._C as C
    assert isinstance(C.built_with_cuda, bool)
    assert C.cpu.max_threads() >= 1


def test_horovodrun_check_build_lists_pytorch_mpi_gloo():
    exe = BIN / "horovodrun"
    if not exe.exists():
        pytest.fail("horovodrun is missing from the venv: run make bootstrap")
    out = subprocess.run([str(exe), "--check-build"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    for line in ("[X] PyTorch", "[X] MPI", "[X] Gloo"):
        assert out.stdout.count(line) >= 1, f"{line!r} missing from:\n{out.stdout}"


@pytest.mark.mpi
def test_horovod_and_mpi4py_share_open_mpi(tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun is missing: run make bootstrap")
    result = tmp_path / "result.json"
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
         str(ROOT / "tests" / "mpi" / "hvd_smoke.py"), str(result)],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(result.read_text())
    assert data["size"] == 2
    assert data["all_ok"], "pack_delta -> hvd.allreduce_ -> unpack_add did not average the ranks"
