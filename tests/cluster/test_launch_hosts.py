"""Three hosts with a real slow link: each host is a network namespace on a private bridge
(tests/cluster/netns.py), one host's link shaped to a few Mbit/s with tc tbf in both directions.
ASHL's planner must see it and give that host the fewest local steps (k_AHL = 8): launched with
mpirun across the hosts, and as a batch job of a 3-node Slurm spanning them."""
import json
import os
import sys

import pytest

from cluster import netns
from cluster.launch import ROOT, SBATCH, TRAIN, job_env, subnet_env

sys.path.insert(0, str(TRAIN.parents[1] / "tests" / "mpi"))
from _util import skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(170),
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]

SLOW_HOST = 2
SLOW_RATE = "4mbit"   # the digits MLP is ~69 KB: ~0.15 s per push or pull, against ~1 ms steps
# --no-overlap: what is checked is the comm-budget plan of a slow link (its H capped at k_AHL);
# with overlapped commits (ashl's default) the slow rank steps while its commit travels, and
# the planner gives it the steps that fill its round trip instead
TRAIN_ARGS = ["--target-accuracy", "0.9", "--max-seconds", "40", "--no-overlap"]


@pytest.fixture
def slow_link(hosts3):
    hosts3.shape(SLOW_HOST, SLOW_RATE)
    qdiscs = hosts3.qdiscs()
    assert qdiscs.count("tbf") == 2, qdiscs   # both ends of the slow host's link
    yield hosts3
    hosts3.unshape(SLOW_HOST)


def check_plan(result):
    ranks = result["ranks"]
    assert len(ranks) == 3
    assert len({r["accuracy"] for r in ranks}) == 1, "ranks ended with different models"
    assert ranks[0]["accuracy"] >= 0.9
    ahl = ranks[0]["plan"]["stages"]["AHL"]["local_steps"]
    shl = ranks[0]["plan"]["stages"]["SHL"]["local_steps"]
    assert 1 <= ahl[SLOW_HOST] <= 8, ahl           # the bottleneck: at most k_AHL (comm budget)
    assert all(h > ahl[SLOW_HOST] for i, h in enumerate(ahl) if i != SLOW_HOST), ahl
    assert shl[SLOW_HOST] == min(shl), shl
    # what the plan assumed: the shaped host's transfers are the slowest of all
    link = [p.get("push_s", 0) + p.get("pull_s", 0) for p in ranks[0]["plan"]["profiles"]]
    assert link[SLOW_HOST] == max(link), f"push + pull seconds per rank {link}"
    return ahl


def test_mpirun_three_hosts_one_throttled(slow_link, tmp_path_factory):
    out = os.path.join(slow_link.work, "mpirun.json")
    cmd = ["mpirun", "-np", 3, *netns.mpirun_args(slow_link), "-x", "PYTHONPATH",
           "-x", "OMP_NUM_THREADS", sys.executable, TRAIN, out, *TRAIN_ARGS]
    import subprocess
    proc = subprocess.run(slow_link.command(0, cmd), capture_output=True, text=True,
                          env=job_env(**subnet_env(netns.SUBNET)), timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_plan(json.loads(open(out).read()))


def test_slurm_three_nodes_one_throttled(slurm_hosts3, slow_link):
    out = os.path.join(slow_link.work, "slurm.json")
    log = os.path.join(slow_link.work, "slurm-job.out")
    env = job_env(slurm_hosts3.env, **subnet_env(netns.SUBNET))
    job = slurm_hosts3.sbatch_poll(["--nodes=3", "--ntasks=3", "--ntasks-per-node=1", f"--output={log}",
                                    SBATCH, out, *TRAIN_ARGS], timeout=150, env=env, cwd=ROOT)
    output = open(log).read() if os.path.exists(log) else "(no job output)"
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", \
        f"{job}\n--- job output\n{output[-4000:]}\n{slurm_hosts3.logs()}"
    assert job["NodeList"] == "ashl-h[0-2]"
    assert "3 tasks" in output and "launcher srun" in output, output
    check_plan(json.loads(open(out).read()))
