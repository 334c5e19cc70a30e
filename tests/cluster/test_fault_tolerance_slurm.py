"""examples/slurm/ashl-ft.sbatch in a real Slurm allocation (slurmctld + slurmd on this
machine): mpirun --enable-recovery inside it, one rank killed with kill -9 mid-run, the
others reach the target and the job's exit code says a worker was lost (3)."""
import json
import os
import signal
import sys
import threading
import time

import psutil
import pytest

from cluster.launch import ROOT, job_env

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "mpi"))
from _util import skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(200),
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]

SBATCH_FT = ROOT / "examples" / "slurm" / "ashl-ft.sbatch"


def rank_pid(rank: int, out: str):
    """The pid of `rank` of the job writing to `out` (it runs under slurmd, not under us)."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            if out in " ".join(p.info["cmdline"] or []) and \
                    p.environ().get("OMPI_COMM_WORLD_RANK") == str(rank):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def commits(out: str) -> int:
    path = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(x) for x in open(path).read().splitlines() if x.endswith("}")] \
        if os.path.exists(path) else []
    return max([r.get("commits") or 0 for r in rows] + [0])


def test_sbatch_fault_tolerant_job_loses_a_rank_and_finishes(slurm_local, tmp_path):
    out = str(tmp_path / "ft")
    log = tmp_path / "job.out"
    job = {}
    # 4 tasks on this machine's 2 CPUs: --overcommit (GPU-like steps mostly sleep)
    args = [f"--output={log}", "--ntasks=4", "--overcommit", SBATCH_FT, out, "--model", "mlp", "--lr", "0.01",
            "--compute-slowdown", "1,1,2,4", "--target-accuracy", "0.96", "--max-seconds", "90",
            "--eval-every", "0.2", "--no-progress"]
    env = job_env(slurm_local.env, ASHL_EMULATE_STEP_TIME="0.02")
    waiter = threading.Thread(target=lambda: job.update(
        slurm_local.sbatch_poll(args, timeout=170, env=env, cwd=ROOT)))
    waiter.start()
    deadline = time.monotonic() + 120
    while commits(out) < 20:
        assert waiter.is_alive() and time.monotonic() < deadline, \
            (log.read_text()[-3000:] if log.exists() else f"no job output: {job}")
        time.sleep(0.1)
    os.kill(rank_pid(2, out), signal.SIGKILL)
    waiter.join(180)
    output = log.read_text() if log.exists() else "(no job output)"
    assert job.get("ExitCode") == "3:0", f"{job}\n{output[-4000:]}\n{slurm_local.logs()}"
    assert "launcher mpirun --enable-recovery" in output
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert [x["rank"] for x in summary["lost_ranks"]] == [2]
    assert summary["stop_reason"].startswith("target accuracy")
