"""A fault-tolerant run across three emulated hosts (network namespaces on one bridge) loses
a host: its link is removed mid-run, so its rank falls silent (no closed connection, no
reset: the ZMTP heartbeats stop). The server drops it after --fault-timeout, the others
reach the target, and the job's status (python -m ashl.run) says a rank was lost."""
import json
import os
import subprocess
import sys
import time

import pytest

from ashl.netns import run as net
from cluster import netns
from cluster.launch import ROOT, job_env, subnet_env

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "mpi"))
from _util import skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(200),
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]

CUT_HOST = 2


def metrics(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path).read().splitlines() if line.endswith("}")]


def test_a_host_cut_off_mid_run_is_dropped_and_the_others_reach_the_target(hosts3):
    out = os.path.join(hosts3.work, "ft-cut")
    cmd = [sys.executable, "-m", "ashl.run", "--status-dir", os.path.join(out, "status"),
           "mpirun", "-np", 3, *netns.mpirun_args(hosts3), "--enable-recovery",
           "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "ASHL_EMULATE_STEP_TIME",
           sys.executable, "-m", "ashl.train", "--fault-tolerant", "--fault-timeout", "2",
           "--out", out, "--model", "mlp", "--lr", "0.01", "--target-accuracy", "0.96",
           "--max-seconds", "100", "--eval-every", "0.2", "--no-progress"]
    os.makedirs(out, exist_ok=True)
    env = job_env(**subnet_env(netns.SUBNET), ASHL_EMULATE_STEP_TIME="0.02")
    log = open(os.path.join(out, "job.log"), "w")
    job = subprocess.Popen(hosts3.command(0, cmd), stdout=log, stderr=subprocess.STDOUT,
                           env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 90
        while not any((r.get("commits") or 0) >= 20 for r in metrics(out)):
            assert job.poll() is None and time.monotonic() < deadline, open(log.name).read()[-3000:]
            time.sleep(0.1)
        # host 2's cable pulled: its end of the bridge goes down, nothing is closed or reset
        net(["ip", "-n", netns.SWITCH, "link", "set", f"h{CUT_HOST}", "down"])
        try:
            rc = job.wait(150)
        except subprocess.TimeoutExpired:
            log.flush()
            pytest.fail("the job hung after the cut:\n" + open(log.name).read()[-5000:])
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
        hosts3.stop_processes()
        net(["ip", "-n", netns.SWITCH, "link", "set", f"h{CUT_HOST}", "up"], check=False)
    text = open(log.name).read()
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert [x["rank"] for x in summary["lost_ranks"]] == [CUT_HOST], text[-3000:]
    assert "heartbeat" in summary["lost_ranks"][0]["why"] or "silent" in summary["lost_ranks"][0]["why"]
    assert summary["stop_reason"].startswith("target accuracy"), text[-3000:]
    assert rc == 3, text[-3000:]
