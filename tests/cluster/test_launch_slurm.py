"""examples/slurm/ashl.sbatch through a real Slurm (slurmctld + slurmd on this machine, munge):
sbatch --wait, a 2-task job, its result file; srun --mpi=pmix and mpirun inside the allocation."""
import json
import sys

import pytest

from cluster.launch import RANK_INFO, ROOT, SBATCH, check_world, job_env, read_rank_files

sys.path.insert(0, str(RANK_INFO.parents[1] / "mpi"))
from _util import skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(150),
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]


def sbatch(cluster, tmp_path, *args, env=None, timeout=120):
    log = tmp_path / "job.out"
    proc = cluster.sbatch_wait([f"--output={log}", *map(str, args)], timeout=timeout,
                               env=job_env(cluster.env, **(env or {})), cwd=ROOT)
    output = log.read_text() if log.exists() else "(no job output)"
    assert proc.returncode == 0, (f"sbatch --wait failed ({proc.returncode}):\n{proc.stdout}\n"
                                  f"{proc.stderr}\n--- job output\n{output[-4000:]}\n"
                                  f"{cluster.logs()}")
    return output


def check_training(result, np_, target):
    ranks = result["ranks"]
    assert len(ranks) == np_
    assert len({r["accuracy"] for r in ranks}) == 1, "ranks ended with different models"
    assert ranks[0]["accuracy"] >= target
    assert "target accuracy" in result["events"][-1]["reason"]
    ahl = ranks[0]["plan"]["stages"]["AHL"]["local_steps"]
    # the bottleneck's steps come from what a commit costs here (the comm budget), at most k_AHL
    assert len(ahl) == np_ and 1 <= min(ahl) <= 8, ahl
    return ahl


def test_sbatch_example_trains_on_two_tasks(slurm_local, tmp_path):
    out = tmp_path / "result.json"
    log = sbatch(slurm_local, tmp_path, "--ntasks=2", SBATCH, out,
                 "--target-accuracy", "0.9", "--max-seconds", "45")
    assert "2 tasks" in log and "launcher srun" in log, log
    check_training(json.loads(out.read_text()), 2, 0.9)


def test_sbatch_example_with_mpirun_inside_the_allocation(slurm_local, tmp_path):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    log = sbatch(slurm_local, tmp_path, "--ntasks=2", SBATCH, ranks,
                 env={"ASHL_LAUNCHER": "mpirun", "ASHL_SCRIPT": RANK_INFO})
    assert "launcher mpirun" in log
    check_world(read_rank_files(ranks, 2), size=2, per_host=2)
