"""strategy="ashl-sync": per-rank H_i and shares, each round one hvd.allreduce_; every rank
runs its own StageMachine on allreduced numbers, so all ranks switch and stop together.

Real multi-rank runs under mpirun (marked ``mpi``) of examples/train_digits.py and of a
small script that leaves early.
"""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import _util  # noqa: E402

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"   # the user's script

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(_util.skip_reason() is not None,
                                 reason=_util.skip_reason() or "")]


def mpirun(np_, script, *args, timeout=180):
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none", sys.executable,
           str(script), *map(str, args)]
    env = _util.mpi_env()
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    # mpirun exits non-zero if any rank does: every rank exited 0 when this holds.
    assert proc.returncode == 0, (f"mpirun {Path(script).name} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("np_", [3, 4])
def test_ranks_reach_the_target_with_the_same_model_and_rounds(np_, tmp_path):
    out = tmp_path / "result.json"
    mpirun(np_, TRAIN, out, "--strategy", "ashl-sync", "--max-seconds", "90")
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == list(range(np_))
    accuracies = {r["accuracy"] for r in ranks}
    assert len(accuracies) == 1, f"ranks ended with different models: {accuracies}"
    assert ranks[0]["accuracy"] >= 0.9
    for r in ranks:
        stages = r["stages"]
        assert "AHL" in stages and stages[-1] == "DONE", stages
        c = r["counters"]
        assert c["stop_reason"].startswith("target accuracy"), c["stop_reason"]
        assert c["rounds"] == c["commits"] and c["global_commits"] == c["rounds"] * np_
        assert c["bytes_sent"] > 0 and c["idle_s"] >= 0 and c["rejected"] == 0
    # One allreduce per round on every rank, so the round counts agree...
    assert len({r["counters"]["commits"] for r in ranks}) == 1
    # ...and so do the stage machines (same switch, same stop, same round).
    transitions = [[(t["from"], t["to"], t["commits"], t["reason"]) for t in r["transitions"]]
                   for r in ranks]
    assert all(t == transitions[0] for t in transitions), transitions
    seen = [t[1] for t in transitions[0]]
    assert seen[0] == "AHL" and seen[-1] == "DONE"
    if "SHL" in seen:                      # the loss switch (or AHL budget) happened
        assert all("SHL" in r["stages"] for r in ranks)
    # Each rank does its own H_i per round: local steps follow the plan, not one count.
    plan = ranks[0]["plan"]
    assert plan["stages"]["AHL"]["local_steps"] == ranks[-1]["plan"]["stages"]["AHL"]["local_steps"]


LEAVER = textwrap.dedent("""
    import json, sys
    from mpi4py import MPI
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F
    import ashl.torch as ashl
    from ashl.stages import StageConfig

    out, leave_after = sys.argv[1], int(sys.argv[2])
    hvd.init(comm=MPI.COMM_WORLD)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = ashl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    model=model, strategy="ashl-sync", profile_steps=4,
                                    stage_config=StageConfig(max_seconds=60))
    ashl.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    steps = 0
    while not opt.finished:
        if hvd.rank() == 1 and steps == leave_after:
            break                      # this rank leaves while the others keep training
        x = torch.randn(16, 8, generator=g)
        y = (x[:, 0] > 0).long()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(loss=loss)
        steps += 1
    opt.finish()
    state = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()
                       if t.is_floating_point()])
    res = {"rank": hvd.rank(), "state": state.tolist(), "counters": opt.counters(),
           "stage": opt.stage, "transitions": opt.strategy.transitions}
    res = MPI.COMM_WORLD.gather(res, root=0)
    if hvd.rank() == 0:
        json.dump(res, open(out, "w"), default=str)
""")


@pytest.mark.parametrize("leave_after", [2, 40], ids=["while-profiling", "while-training"])
def test_a_rank_that_finishes_early_stops_everyone_on_the_same_round(leave_after, tmp_path):
    script = tmp_path / "leaver.py"
    script.write_text(LEAVER)
    out = tmp_path / "result.json"
    mpirun(3, script, out, leave_after, timeout=120)
    ranks = json.loads(out.read_text())
    assert len({json.dumps(r["state"]) for r in ranks}) == 1   # BatchNorm buffers included
    # the leaving rank joined: the others' last round took zeros from it, and stopped
    commits = [r["counters"]["commits"] for r in ranks]
    assert commits[0] == commits[2] == commits[1] + 1
    assert all(r["stage"] == "DONE" for r in ranks)
    assert ranks[1]["counters"]["left_early"]
    assert not ranks[0]["counters"]["left_early"] and not ranks[2]["counters"]["left_early"]
    for r in ranks:
        assert "called finish()" in r["counters"]["stop_reason"]
        assert r["transitions"] == ranks[0]["transitions"]


def test_needs_horovod_initialised(tmp_path):
    code = textwrap.dedent("""
        from mpi4py import MPI
        import horovod.torch  # imported, never initialised
        import torch
        from ashl.strategies import make_strategy
        model = torch.nn.Linear(2, 2)
        try:
            make_strategy("ashl-sync", model, list(model.parameters()))
        except RuntimeError as exc:
            print("ERROR:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_util.mpi_env(), timeout=120)
    assert "ERROR:" in proc.stdout and "hvd.init" in proc.stdout, proc.stdout + proc.stderr
