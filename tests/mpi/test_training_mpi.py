"""ASHL end to end: real ranks under mpirun, real Horovod, the user API, digits."""
import json
import sys
from pathlib import Path

import pytest
import torch

from _util import horovodrun, mpirun, skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(skip_reason() is not None,
                                                  reason=str(skip_reason()))]
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


def train(np_, out, *args, env=None):
    mpirun(np_, SCRIPT, out, *args, timeout=180, env=env)
    return json.loads(Path(out).read_text())


def check_run(result, np_, target):
    ranks = result["ranks"]
    assert len(ranks) == np_
    accuracies = {r["accuracy"] for r in ranks}
    assert len(accuracies) == 1, f"ranks ended with different models: {accuracies}"
    assert accuracies.pop() >= target
    for r in ranks:
        assert r["stages"][0] == "PROFILE" and r["stages"][-1] == "DONE", r["stages"]
        assert r["counters"]["rejected"] == 0
    return ranks[0]["counters"]["server"]


@pytest.mark.parametrize("np_", [3, 4])
def test_ranks_reach_the_target_through_every_stage(np_, tmp_path):
    out = tmp_path / "result.json"
    # An AHL budget of 16 commits (all ranks) and a target that takes longer than that, so
    # the run passes through SHL even when the loss switch is slow to come.
    result = train(np_, out, "--target-accuracy", "0.96", "--ahl-max-commits", "16",
                   "--max-seconds", "120")
    server = check_run(result, np_, 0.96)
    stages = [e["to"] for e in result["events"]]
    assert stages == ["AHL", "SHL", "DONE"], result["events"]
    assert "target accuracy" in result["events"][-1]["reason"]
    # SHL's bound: no reply ever let a rank run more than 3 commits ahead of the slowest
    assert server["shl_log"], "no SHL commit was made"
    assert all(mine - slowest <= 3 for _, mine, slowest in server["shl_log"])
    assert server["max_shl_lead"] <= 3
    for r in result["ranks"]:
        plan = r["plan"]["stages"]
        for stage in ("AHL", "SHL"):   # the bottleneck takes k, everyone else at least k
            steps, k = plan[stage]["local_steps"], plan[stage]["k"]
            assert k <= (8 if stage == "AHL" else 2)
            # overlapped (ashl's default), a round its link bounds fits more than k steps on
            # every rank, the bottleneck's too (planner.rank_steps)
            assert min(steps) >= k if r["plan"]["config"]["overlap"] else min(steps) == k


def test_checkpoint_and_resume_continue_the_run(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    first = train(3, tmp_path / "first.json", "--max-commits", "60", "--target-accuracy", "0.999",
                  "--checkpoint", ckpt)
    assert "commit budget" in first["events"][-1]["reason"]
    saved = torch.load(ckpt, weights_only=False)
    assert saved["stage"] in ("AHL", "SHL") and saved["size"] == 3
    saved_commits = {r: torch.load(f"{ckpt}.rank{r}", weights_only=False)["counters"]["commits"]
                     for r in range(3)}

    second = train(3, tmp_path / "second.json", "--resume", ckpt, "--target-accuracy", "0.95",
                   "--max-seconds", "60")
    check_run_resumed(second, saved, saved_commits)


def test_every_epoch_is_one_permutation_of_the_data_while_the_plan_changes(tmp_path):
    """Uneven ranks are in different epochs when a re-plan or the stage switch reaches them;
    each took the new shares at its own next epoch, so an epoch read some samples twice and
    skipped others (21 of 67 epochs in a review's run). Now every rank takes them from the
    epoch the coordinator names."""
    out = tmp_path / "epochs.json"
    # GPU-like steps (5 and 15 ms), so that a loaded machine does not make their rounds
    # and epochs irregular
    mpirun(2, Path(__file__).with_name("shares_epochs.py"), out, timeout=150,
           env={"ASHL_EMULATE_COMPUTE": "1,3", "ASHL_EMULATE_STEP_TIME": "0.005"})
    result = json.loads(out.read_text())
    assert len(result["epochs"]) >= 5
    bad = [e for e, per_rank in result["epochs"].items()
           if sorted(sum(per_rank, [])) != list(range(result["n"]))]
    # A rank that had begun the named epoch when it heard counts it (and warns): one such
    # event at the most in a CI run on 2 busy cores, and no bad epoch without one
    assert sum(result["late"]) <= 1, result["late"]
    assert len(bad) <= 3 * sum(result["late"]), \
        {e: [len(r) for r in result["epochs"][e]] for e in bad}
    # and the shares did change: the slow rank reads fewer in the late epochs
    last = result["epochs"][max(result["epochs"], key=int)]
    assert len(last[1]) < len(last[0])


@pytest.mark.parametrize("strategy", ["ashl", "localsgd", "diloco", "ashl-sync"])
def test_a_checkpoint_loaded_on_rank_0_alone_is_refused_on_every_rank(tmp_path, strategy):
    """Horovod's recipe (rank 0 loads, then broadcasts) applied to ashl's checkpoint left
    rank 0 in the resume's barrier and the others profiling, for ever (ashl), or the other
    ranks with their own counters and no outer momentum (localsgd, diloco)."""
    script = Path(__file__).with_name("rank0_resume.py")
    ckpt = tmp_path / "run.ckpt"
    mpirun(2, script, "--save", ckpt, "--strategy", strategy, timeout=120)
    proc = mpirun(2, script, "--resume", ckpt, "--strategy", strategy, timeout=120,
                  check=False)
    assert proc.returncode != 0, proc.stderr
    # every rank raises it; the first to end the job may cut the other's line short
    assert ("of 2 ended with an uncaught ValueError: load_checkpoint was called on rank(s) "
            "[0] only, of 2: call it on every rank") in proc.stderr


def test_an_outer_optimizer_through_both_stages_and_a_resume_keeps_its_momentum(tmp_path):
    """ashl with Delayed Nesterov on the server, dense AHL then top-k SHL with error feedback;
    the checkpoint carries the momentum and the resumed run continues from it."""
    ckpt, outer = tmp_path / "run.ckpt", "delayed-nesterov(0.5, 0.5)"
    first = train(3, tmp_path / "first.json", "--outer-optimizer", outer, "--max-commits", "60",
                  "--target-accuracy", "0.999", "--ahl-max-commits", "16", "--checkpoint", ckpt)
    assert "commit budget" in first["events"][-1]["reason"]
    saved = torch.load(ckpt, weights_only=False)
    assert saved["outer"]["spec"] == "delayed-nesterov(0.5, 0.5, 3)"
    assert saved["outer"]["updates"] > 0 and saved["outer"]["momentum"].abs().sum() > 0
    saved_commits = {r: torch.load(f"{ckpt}.rank{r}", weights_only=False)["counters"]["commits"]
                     for r in range(3)}

    second = train(3, tmp_path / "second.json", "--outer-optimizer", outer, "--resume", ckpt,
                   "--target-accuracy", "0.95", "--max-seconds", "60", "--ahl-max-commits", "16")
    check_run_resumed(second, saved, saved_commits)
    c = second["ranks"][0]["counters"]
    # the outer optimizer's count went on from the checkpoint's (a fresh one counts from 0):
    # its state was loaded. The checkpoint is the last epoch's, and can already be at the
    # target: the resumed run may then end at its first evaluation, before any merge
    updates, merged = c["outer"]["updates"] - saved["outer"]["updates"], c["server"]["merged"]
    assert 0 <= updates <= merged and (updates >= 1 or merged == 0), (updates, merged)
    assert "SHL" in [e["to"] for e in first["events"] + second["events"]]

    # a resume that asks for another outer optimizer is refused on every rank, named
    proc = mpirun(3, SCRIPT, tmp_path / "third.json", "--outer-optimizer", "nesterov", "--resume",
                  ckpt, "--max-seconds", "30", timeout=120, check=False)
    assert proc.returncode != 0
    assert "was trained with outer_optimizer='delayed-nesterov(0.5, 0.5, 3)'" in proc.stderr


def test_diloco_checkpoints_its_momentum_and_resumes_from_it(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    # outer momentum 0.5: DiLoCo's 0.9 diverges on this small job in some runs
    outer = ("--outer-optimizer", "nesterov(0.7, 0.5)")
    train(3, tmp_path / "first.json", "--strategy", "diloco", *outer, "--max-commits", "45",
          "--target-accuracy", "0.999", "--checkpoint", ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["strategy"] == "diloco" and saved["outer"]["spec"] == "nesterov(0.7, 0.5)"
    assert saved["outer"]["updates"] > 0 and saved["outer"]["momentum"].abs().sum() > 0
    second = train(3, tmp_path / "second.json", "--strategy", "diloco", *outer, "--resume",
                   ckpt, "--target-accuracy", "0.9", "--max-seconds", "60")
    ranks = second["ranks"]
    assert len({r["resumed_accuracy"] for r in ranks}) == 1     # the same model everywhere
    assert len({r["accuracy"] for r in ranks}) == 1 and ranks[0]["accuracy"] >= 0.9
    for r in ranks:     # every rank's outer optimizer went on from the saved momentum
        assert r["counters"]["outer"]["updates"] > saved["outer"]["updates"]
    # localsgd cannot take a diloco checkpoint: refused on every rank, named
    proc = mpirun(3, SCRIPT, tmp_path / "third.json", "--strategy", "localsgd", "--resume",
                  ckpt, "--max-seconds", "30", timeout=120, check=False)
    assert proc.returncode != 0 and "is of strategy 'diloco'" in proc.stderr


def check_run_resumed(second, saved, saved_commits):
    ranks = second["ranks"]
    # every rank started from the checkpointed global model: the same accuracy on all
    assert len({r["resumed_accuracy"] for r in ranks}) == 1
    assert ranks[0]["stages"][0] == saved["stage"], "the run did not resume in its stage"
    assert second["events"][0]["reason"].startswith("resumed from a checkpoint")
    for r in ranks:
        assert r["counters"]["commits"] > saved_commits[r["rank"]]   # counters continue
    assert ranks[0]["accuracy"] >= 0.95


def test_timeline_has_every_ranks_compute_and_commit_spans(tmp_path):
    trace = tmp_path / "timeline.json"
    train(3, tmp_path / "r.json", "--max-commits", "30", "--target-accuracy", "0.999",
          env={"ASHL_TIMELINE": str(trace)})
    events = json.loads(trace.read_text())["traceEvents"]
    for rank in range(3):
        names = {e["name"] for e in events if e.get("pid") == rank}
        assert {"compute", "commit", "plan"} <= names, (rank, names)
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_horovodrun_launches_the_same_script(tmp_path):
    out = tmp_path / "r.json"
    proc = horovodrun("-np", 3, "-H", "localhost:3", sys.executable, SCRIPT, out,
                      "--target-accuracy", "0.9")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_run(json.loads(out.read_text()), 3, 0.9)


def test_gloo_launch_is_refused_with_a_clear_error(tmp_path):
    proc = horovodrun("--gloo", "-np", 2, "-H", "localhost:2", sys.executable, SCRIPT,
                      tmp_path / "r.json", timeout=90)
    assert proc.returncode != 0
    assert "ashl needs an MPI launch" in proc.stdout + proc.stderr


# localsgd's background evaluation runs in tests/unit/test_evaluation.py (FakeWorld); bsp
# needs real Horovod, the parameter server real transports
@pytest.mark.parametrize("strategy", ["ashl", "bsp"])
def test_a_background_evaluator_and_no_finish_call_exit_cleanly(tmp_path, strategy):
    """The evaluation thread's pool is shut down at exit before ashl leaves the run there:
    the exit must start no evaluation (it raised 'cannot schedule new futures', aborting
    the job), and the evaluations taken during the run must have been counted."""
    out = tmp_path / "result.json"
    mpirun(3, Path(__file__).parent / "background_eval_script.py", "--strategy", strategy,
           "--out", out, timeout=180)
    result = json.loads(out.read_text())
    assert result["evaluations"] >= 1 and result["accuracy"] is not None
