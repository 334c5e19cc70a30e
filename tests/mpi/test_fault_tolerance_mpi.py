"""Fault-tolerant runs lose workers to a real kill -9 and go on (issue: survivors carry on,
nothing merged is lost). Each job is ``python -m ashl.run mpirun --enable-recovery ...
python -m ashl.train --fault-tolerant`` on 4 GPU-like uneven ranks (10 ms x 1,1,2,4)."""
import json
import re
import time
from pathlib import Path

import pytest

from _util import skip_reason
from faults import TARGET, Job, accounting_problems, commits_at_least, in_stage

pytestmark = [pytest.mark.mpi, pytest.mark.slow,
              pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]

LOST = 3    # ashl.torch.exit.LOST_RANKS_STATUS


def check_nothing_merged_is_lost(job: Job, lost: list[int], target: float = TARGET) -> dict:
    """The run reached its target without the lost ranks, named them, and the server merged
    exactly what each worker was told it merged (the lost ones: what the server counted)."""
    problems = accounting_problems(job, lost, target)
    assert not problems, "\n".join(problems) + "\n" + job.text()[-3000:]
    return job.summary()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["AHL", "SHL"])
def test_a_killed_worker_is_dropped_and_the_others_reach_the_target(stage, tmp_path):
    job = Job(tmp_path, 4, "--max-seconds", "90")
    job.wait_for(f"training in {stage}", commits_at_least(20) if stage == "AHL" else in_stage("SHL"))
    killed_at = job.kill(2)
    rc = job.finish()
    assert rc == LOST, job.text()[-3000:]
    summary = check_nothing_merged_is_lost(job, [2])
    assert summary["plan"]["version"] >= 2          # re-planned among the survivors
    assert "rank(s) 2 left no exit status" in job.text()
    assert time.monotonic() - killed_at < 120


@pytest.mark.timeout(180)
def test_horovodrun_with_recovery_loses_a_worker_and_says_so(tmp_path):
    job = Job(tmp_path, 4, "--max-seconds", "90", launcher="horovodrun")
    job.wait_for("the first commits", commits_at_least(20))
    job.kill(1)
    assert job.finish() == LOST, job.text()[-3000:]
    check_nothing_merged_is_lost(job, [1])


@pytest.mark.timeout(240)
def test_two_workers_killed_one_after_the_other(tmp_path):
    job = Job(tmp_path, 4, "--max-seconds", "120")
    job.wait_for("the first commits", commits_at_least(20))
    job.kill(3)
    job.wait_for("more commits", commits_at_least(60))
    job.kill(1)
    assert job.finish(180) == LOST, job.text()[-3000:]
    check_nothing_merged_is_lost(job, [3, 1])


@pytest.mark.timeout(300)
def test_the_server_killed_every_worker_stops_naming_it_and_the_checkpoint_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = Job(tmp_path / "run", 4, "--max-seconds", "90", "--checkpoint-dir", ckpt,
              "--checkpoint-every", "0.5")
    job.wait_for("a checkpoint mid-run",
                 lambda rows: (ckpt / "ckpt.pt").exists() and commits_at_least(40)(rows))
    job.kill(0)
    rc = job.finish(timeout=30)      # every worker out within 30 s of the server's death
    text = job.text()
    assert rc == 1, text[-3000:]     # a failed run, not one that went on without a worker
    for r in (1, 2, 3):
        assert f"rank {r} of 4 ended with an uncaught ServerLost: lost the parameter server " \
               "(rank 0" in text, text[-3000:]
    assert "rank(s) 0 left no exit status" in text

    resumed = Job(tmp_path / "resumed", 4, "--max-seconds", "90", "--checkpoint-dir", ckpt,
                  "--resume")
    assert resumed.finish() == 0, resumed.text()[-3000:]
    summary = resumed.summary()
    assert summary["resumed"] and summary["lost_ranks"] == []
    assert summary["final_accuracy"] >= TARGET


@pytest.mark.timeout(300)
def test_a_replacement_joins_mid_run_takes_the_lost_slot_and_commits(tmp_path):
    slow = ("--max-seconds", "150", "--lr", "0.004")   # time for the replacement to start
    job = Job(tmp_path, 4, *slow)
    job.wait_for("the first commits", commits_at_least(20))
    job.kill(2)
    job.wait_for_text("rank 2 lost at")
    replacement = job.replacement(*slow)
    assert job.finish(200) == LOST, job.text()[-3000:]
    assert replacement.wait(60) == LOST, (tmp_path / "replacement.log").read_text()[-3000:]
    summary = job.summary()
    assert [x["rank"] for x in summary["lost_ranks"]] == [2]
    server = summary["per_rank"][0]["counters"]["server"]
    mine = job.rank_result(2)["counters"]          # written by the replacement
    assert mine["replaced_rank"] == 2 and mine["accepted"] >= 2
    # the server merged its commits as rank 2's, after what the lost rank had merged
    assert server["merged_by"][2] == summary["lost_ranks"][0]["merged"] + mine["accepted"]
    assert "this replacement took rank 2's slot of 4" in (tmp_path / "replacement.log").read_text()
    assert summary["final_accuracy"] >= TARGET


@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ssp", "asp", "adsp", "async-localsgd"])
def test_every_asynchronous_strategy_survives_a_killed_worker(strategy, tmp_path):
    job = Job(tmp_path, 4, "--strategy", strategy, "--max-seconds", "120",
              "--target-accuracy", "0.93")
    # every rank has committed, well before 0.93: adsp commits every 2 s, and its global
    # model, evaluated on the clock, read 0.87 at 8 commits and 0.93 at 19 in one run
    job.wait_for("the first commits", commits_at_least(8))
    job.kill(2)
    assert job.finish(150) == LOST, job.text()[-3000:]
    check_nothing_merged_is_lost(job, [2], target=0.93)


@pytest.mark.timeout(200)
def test_a_users_script_loses_a_worker_killed_in_the_middle_of_its_commit(tmp_path):
    """Half a message is never a commit: the survivors go on and nothing is half-merged."""
    job = Job(tmp_path, 4, "--die-in-send", 3, "--at-commit", 8,
              script=Path(__file__).parent / "ft_script.py")
    assert job.finish(150) == LOST, job.text()[-3000:]
    # the hook goes in once the rank counts 7 commits; with overlapped commits (ashl's
    # default) the one it catches may be the commit still in flight then, the 7th (number 6)
    killed = re.search(r"rank 3: killed in the middle of commit (\d+)", job.text())
    assert killed and int(killed.group(1)) in (6, 7), job.text()[-3000:]
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1, 2)}
    assert not (tmp_path / "rank3.json").exists()
    server = results[0]["counters"]["server"]
    # every commit before the half-sent one was merged, the half-sent one never
    assert server["merged_by"][3] == int(killed.group(1)) and server["rejected_invalid"] == 0
    for r, result in results.items():
        assert [x["rank"] for x in result["lost_ranks"]] == [3]
        assert result["counters"]["accepted"] == server["merged_by"][r]
        assert result["stop_reason"].startswith("target accuracy")
        assert result["accuracy"] >= 0.95


@pytest.mark.timeout(120)
def test_a_worker_lost_while_profiling_ends_the_job_instead_of_hanging_it(tmp_path):
    """Profiling is collective: the others cannot go on without the lost rank, and must not
    wait for it for ever either."""
    job = Job(tmp_path, 4, "--die-at-step", 2, "--startup-timeout", 20,
              script=Path(__file__).parent / "ft_script.py")
    rc = job.finish(90)
    text = job.text()
    assert "rank 2: killed while profiling" in text
    assert "a rank was lost before training began; ending the job" in text
    assert rc == 1, text[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option,value,says", [
    ("--strategy", "localsgd", "strategy 'localsgd' is synchronous and fail-stop"),
    ("--transport", "mpi", "the fault-tolerant run could not start")])
def test_a_fault_tolerant_run_that_cannot_start_fails_the_job(option, value, says, tmp_path):
    """mpirun --enable-recovery reports 0 whatever its ranks' statuses; a run refused on
    every rank (or failing to start on one) leaves its failure for ashl.run."""
    job = Job(tmp_path, 3, option, value, script=Path(__file__).parent / "ft_script.py")
    rc = job.finish(90)
    assert rc == 1 and says in job.text(), job.text()[-3000:]
