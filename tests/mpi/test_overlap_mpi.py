"""Overlapped commits end to end: real ranks under mpirun, emulated uneven compute and links,
``DistributedOptimizer(..., overlap=True)`` through examples/train_digits.py.

Each run reaches its target, every rank ends with the same model, the ranks did step while
their commits were in flight, and the server merged exactly the commits each rank was told
were merged (nothing counted twice, nothing lost between the two ends). No timing thresholds.
"""
import json
from pathlib import Path

import pytest

from _util import mpirun, skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(skip_reason() is not None,
                                                  reason=str(skip_reason()))]
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
# uneven ranks and links, GPU-like steps: a commit's round trip spans several steps
UNEVEN = {"ASHL_EMULATE_COMPUTE": "1,2,4", "ASHL_EMULATE_LINK": "1,4,8",
          "ASHL_EMULATE_LINK_BASE": "0.005,4e6", "ASHL_EMULATE_STEP_TIME": "0.004"}


def train(strategy, tmp_path, *args):
    out = tmp_path / f"{strategy}.json"
    mpirun(3, SCRIPT, out, "--strategy", strategy, "--overlap", "--max-seconds", "90",
           *args, timeout=170, env=UNEVEN)
    return json.loads(out.read_text())


def check_overlapped_run(result, target):
    ranks = result["ranks"]
    assert len({r["accuracy"] for r in ranks}) == 1, "ranks ended with different models"
    assert ranks[0]["accuracy"] >= target
    assert ranks[0]["counters"]["stop_reason"].startswith("target accuracy")
    server = ranks[0]["counters"]["server"]
    for r in ranks:
        c = r["counters"]
        assert c["overlap"]["enabled"] and c["rejected"] == 0
        # every commit but a blocking last one went out overlapped, and the rank stepped on
        assert c["overlap"]["overlapped_commits"] >= c["commits"] - 1 >= 1
        assert c["overlap"]["overlapped_steps"] >= 1
        # the server merged exactly what this rank was told it merged
        assert server["merged_by"][r["rank"]] == c["accepted"], (r["rank"], server, c)
    assert server["merged"] == sum(r["counters"]["accepted"] for r in ranks)
    return server


def test_ashl_with_overlap_reaches_the_target_through_both_stages(tmp_path):
    # an AHL budget of 3 commits (the profiling round's), so the run also passes through SHL
    # and its bound: with 12, the fast ranks' steps while the x4 rank profiled sometimes
    # reached the target within AHL
    result = train("ashl", tmp_path, "--target-accuracy", "0.95", "--ahl-max-commits", "3")
    server = check_overlapped_run(result, 0.95)
    assert [e["to"] for e in result["events"]] == ["AHL", "SHL", "DONE"], result["events"]
    # SHL's bound still holds: no reply let a rank run more than 3 SHL commits ahead
    assert server["max_shl_lead"] <= 3
    plan = result["ranks"][0]["plan"]
    assert plan["config"]["overlap"] is True


def test_asp_with_overlap_reaches_the_target(tmp_path):
    result = train("asp", tmp_path, "--target-accuracy", "0.9")
    check_overlapped_run(result, 0.9)
