"""transport="zmq"|"mpi" under mpirun: both carry a run to its target and the server's
statistics reach summary.json; a fail-stop run over ZeroMQ that loses a worker (frozen, so
Open MPI does not see it go) ends with an error naming it instead of hanging."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

import _util
from faults import rank_pids

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(_util.skip_reason() is not None, reason=_util.skip_reason() or "")]

TRAIN = ("--model", "mlp", "--dataset", "digits", "--no-progress", "--eval-every", "0.2")


def train_command(np_, out, *args):
    return ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", sys.executable,
            "-m", "ashl.train", *TRAIN, "--out", str(out), *map(str, args)]


def env():
    e = _util.mpi_env()
    e.update(OMP_NUM_THREADS="1", ASHL_EMULATE_STEP_TIME="0.02")
    return e


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", ["zmq", "mpi"])
def test_both_transports_reach_the_target_and_report_the_server_thread(transport, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(train_command(3, out, "--strategy", "ashl", "--transport", transport,
                                        "--compute-slowdown", "1,2,3", "--target-accuracy",
                                        "0.9", "--max-seconds", "90"),
                          capture_output=True, text=True, env=env(), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["transport"] == transport and s["final_accuracy"] >= 0.9
    assert all(r["counters"]["transport"] == transport for r in s["per_rank"])
    server = s["per_rank"][0]["counters"]["server"]
    assert 0 < server["busy_fraction"] <= 1 and server["thread_wall_s"] > 0
    latency = server["commit_latency"]
    # every commit the server answered at once is timed (not those whose reply was held)
    assert 0 < server["merged"] - server["waits"] <= latency["count"] <= s["commits"]
    assert latency["samples"] == latency["count"]
    assert 0 < latency["median_ms"] <= latency["p95_ms"]


def committed(out, n) -> bool:
    path = out / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines()
            if l.strip().endswith("}")] if path.exists() else []
    return any((r.get("commits") or 0) >= n for r in rows)


@pytest.mark.timeout(150)
def test_a_frozen_worker_ends_a_fail_stop_zmq_run_with_an_error_naming_it(tmp_path):
    """Fail-stop is kept: the run is not survived (no --fault-tolerant); the server's
    heartbeats find the frozen rank, and every rank ends instead of waiting for it."""
    out = tmp_path / "run"
    log = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen(train_command(4, out, "--strategy", "asp", "--compute-slowdown",
                                          "1,1,2,4", "--max-seconds", "90", "--lr", "0.002"),
                            stdout=log, stderr=subprocess.STDOUT, env=env(),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not committed(out, 20):
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.05)
        os.kill(rank_pids(proc.pid)[2], signal.SIGSTOP)
        rc = proc.wait(100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    text = (tmp_path / "job.log").read_text(errors="replace")
    assert rc != 0, text[-3000:]
    assert "LostPeerError: lost rank 2" in text and "fail-stop" in text, text[-3000:]
    assert not (out / "summary.json").exists()     # a failed run, not one that went on


@pytest.mark.timeout(120)
def test_an_mpi_rank_that_reads_slowly_holds_up_no_other_ranks_reply():
    """The server replies to rank 1, then rank 2; rank 1 reads only once rank 2 has its
    reply. With a blocking MPI_Send the server waited on rank 1 (slow_reader.py)."""
    proc = _util.mpirun(3, _util.ROOT / "tests" / "mpi" / "slow_reader.py", timeout=90)
    for rank in range(3):
        assert f"rank {rank} OK" in proc.stdout, proc.stdout[-4000:]
