"""Launch tests/mpi/driver.py under mpirun and collect each rank's JSON."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().parent / "driver.py"


def skip_reason():
    """Why multi-rank tests cannot run here, or None."""
    if shutil.which("mpirun") is None:
        return "mpirun not found (install openmpi-bin)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    return None


def mpi_env():
    from ashl.launch_env import launch_env  # not an MPI job's own launch variables
    env = launch_env(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])),
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        # containers often forbid the cross-memory-attach single-copy path
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def run_driver(np_, out_dir, *args, timeout=60):
    """Run the driver on np_ ranks; returns the per-rank results, rank order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", sys.executable, str(DRIVER),
           "--out", str(out_dir), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=mpi_env(), timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"mpirun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    results = []
    for r in range(np_):
        path = out_dir / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result:\n{proc.stderr[-4000:]}"
        results.append(json.loads(path.read_text()))
    return results


def mpirun(np_, script, *args, timeout=120, env=None, check=True):
    """Run a script on np_ ranks (oversubscribed, unbound); fail with its output if it fails
    (unless `check` is False: then the caller reads the exit status)."""
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", sys.executable,
           str(script), *map(str, args)]
    full_env = mpi_env()
    full_env.update({"OMP_NUM_THREADS": "1", **(env or {})})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    if check and proc.returncode != 0:
        # stderr's tail long enough for a crash's native and Python backtraces
        raise AssertionError(f"mpirun {Path(script).name} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-16000:]}")
    return proc


def bench(command, *args, timeout=120):
    """python -m ashl.bench COMMAND ARGS (one thread per process); the completed process."""
    env = mpi_env()
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "ashl.bench", command, *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def check_bad_bench_option(command, args, needle, tmp_path):
    """`python -m ashl.bench COMMAND ARGS` refuses with status 2, one line naming `needle`,
    and writes no --json."""
    out = tmp_path / "bench.json"
    proc = bench(command, *args, "--json", out, timeout=60)
    assert proc.returncode == 2, proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith(f"ashl.bench {command}: error:") and needle in line, line
    assert not out.exists()


def horovodrun(*args, timeout=120):
    """horovodrun (this venv's) with `args`; returns the completed process."""
    bin_dir = Path(sys.executable).parent
    env = mpi_env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1")
    return subprocess.run([str(bin_dir / "horovodrun"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)
