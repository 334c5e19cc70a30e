"""Faults under real ranks: a mismatched model, a poisoned delta, a rank that dies."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _util import mpi_env, mpirun, skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(skip_reason() is not None,
                                                  reason=str(skip_reason()))]
SCRIPT = Path(__file__).resolve().parent / "fault_run.py"


def launch(np_, *args, timeout=120):
    """(returncode, output, seconds) of a run that may fail."""
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", sys.executable,
           str(SCRIPT), *map(str, args)]
    env = mpi_env()
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def test_mismatched_models_stop_every_rank_naming_the_tensor(tmp_path):
    rc, out, seconds = launch(3, tmp_path / "r.json", "--mismatch-rank", 2)
    assert rc != 0
    assert "model mismatch at tensor 2: rank 2 has 'net.3.weight' (48, 128)" in out
    assert "rank 0 has 'net.3.weight' (64, 128)" in out
    assert seconds < 60   # start-up included; the check itself is one allgather


def test_nonfinite_delta_is_rejected_and_training_goes_on(tmp_path):
    out = tmp_path / "r.json"
    # poisoned right away: its first commit (the profiling steps' delta) holds a NaN
    mpirun(3, SCRIPT, out, "--nan-rank", 1, "--nan-at-commit", 0, timeout=120)
    ranks = {r["rank"]: r for r in json.loads(out.read_text())["ranks"]}
    assert ranks[0]["counters"]["server"]["rejected_nonfinite"] >= 1
    assert ranks[1]["counters"]["rejected"] >= 1
    # the rank resumed from the global model (and its momentum was cleared): it recovered
    assert ranks[1]["counters"]["rejected"] <= 2
    assert len({r["accuracy"] for r in ranks.values()}) == 1
    assert ranks[0]["accuracy"] >= 0.92


@pytest.mark.parametrize("stage", ["AHL", "SHL"])
def test_a_killed_rank_ends_the_job_and_the_checkpoint_resumes(stage, tmp_path):
    ckpt = tmp_path / "run.ckpt"
    extra = ["--ahl-max-commits", 12] if stage == "SHL" else []
    rc, out, seconds = launch(3, tmp_path / "r.json", "--kill-rank", 2, "--kill-at-commit", 4,
                              "--kill-in-stage", stage, "--checkpoint", ckpt,
                              "--target-accuracy", 0.999, *extra)
    assert rc != 0
    assert f"rank 2: killing myself in {stage}" in out
    assert "process rank 2" in out and "signal 9" in out   # the lost rank is named
    assert seconds < 60   # start-up, a few commits, and the end: no rank waits forever
    saved = torch.load(ckpt, weights_only=False)          # still loadable
    assert saved["stage"] in ("AHL", "SHL") and saved["size"] == 3
    for r in range(3):
        torch.load(f"{ckpt}.rank{r}", weights_only=False)

    resumed = tmp_path / "resumed.json"
    mpirun(3, SCRIPT, resumed, "--resume", ckpt, "--target-accuracy", 0.95, timeout=120)
    ranks = json.loads(resumed.read_text())["ranks"]
    assert len({r["resumed_accuracy"] for r in ranks}) == 1
    assert all(r["accuracy"] >= 0.95 for r in ranks)
