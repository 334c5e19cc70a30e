"""ashl.stages: the stage machine fed with injected events, and the running loss."""

from fractions import Fraction

import pytest

from ashl.stages import RunningLoss, Stage, StageConfig, StageMachine


def started(n=2, **cfg):
    m = StageMachine(n, StageConfig(**cfg), start_time=100.0)
    assert m.stage is Stage.PROFILE
    m.begin_training(101.0)
    assert m.stage is Stage.AHL
    return m


def test_profile_to_ahl_is_logged():
    m = started()
    t = m.transitions[0]
    assert (t.from_stage, t.to_stage, t.at_s) == (Stage.PROFILE, Stage.AHL, 1.0)
    assert "plan" in t.reason


def test_global_loss_is_share_weighted_and_needs_every_rank():
    m = started(n=3)
    m.set_weights([Fraction(1, 2), Fraction(1, 4), Fraction(1, 4)])
    m.commit(0, 102.0, loss=1.0)
    m.commit(1, 102.0, loss=2.0)
    assert m.global_loss is None                      # rank 2 has not reported
    m.commit(2, 102.0, loss=4.0)
    assert m.global_loss == pytest.approx(0.5 * 1 + 0.25 * 2 + 0.25 * 4)
    m.commit(0, 103.0, loss=0.0)                      # the latest report of each rank counts
    assert m.global_loss == pytest.approx(1.5)


def test_switch_on_loss_is_one_way():
    m = started(switch_loss=0.3)
    m.commit(0, 102.0, loss=0.5)
    m.commit(1, 102.0, loss=0.4)
    assert m.stage is Stage.AHL
    m.commit(0, 103.0, loss=0.1)                      # mean 0.25 < 0.3
    assert m.stage is Stage.SHL
    assert "switch_loss" in m.transitions[-1].reason
    m.commit(0, 104.0, loss=5.0)
    assert m.stage is Stage.SHL


def test_switch_on_ahl_commit_budget():
    m = started(ahl_max_commits=5)
    for i in range(4):
        assert m.commit(i % 2, 102.0 + i, loss=1.0) is Stage.AHL
    assert m.commit(0, 110.0, loss=1.0) is Stage.SHL
    assert "AHL commit budget" in m.transitions[-1].reason


def test_switch_on_ahl_time_budget_by_tick():
    m = started(ahl_max_seconds=10.0)
    assert m.tick(110.9) is Stage.AHL
    assert m.tick(111.0) is Stage.SHL                 # AHL began at 101


def test_ahl_budget_derived_from_run_budget_or_default():
    assert StageConfig(max_commits=100).ahl_budgets(4) == (None, 50)
    assert StageConfig(max_seconds=60).ahl_budgets(4) == (30.0, None)
    assert StageConfig().ahl_budgets(4) == (None, 2000)   # never unbounded


def test_done_on_target_loss_wins_over_switch():
    m = started(switch_loss=0.3, target_loss=0.05)
    m.commit(0, 102.0, loss=0.01)
    m.commit(1, 102.0, loss=0.02)
    assert m.stage is Stage.DONE and m.done
    assert "target loss" in m.stop_reason


def test_done_on_target_accuracy():
    m = started(target_accuracy=0.9)
    m.evaluation(102.0, accuracy=0.5)
    assert m.stage is Stage.AHL
    m.evaluation(103.0, accuracy=0.91)
    assert m.stage is Stage.DONE and "accuracy" in m.stop_reason


def test_done_on_time_budget_counts_profiling():
    m = StageMachine(2, StageConfig(max_seconds=5.0), start_time=0.0)
    assert m.tick(4.0) is Stage.PROFILE
    assert m.tick(5.0) is Stage.DONE


def test_done_on_commit_budget_through_shl():
    m = started(max_commits=6, switch_loss=10.0)
    m.commit(0, 102, loss=1.0)
    m.commit(1, 102, loss=1.0)
    assert m.stage is Stage.SHL
    for i in range(3):
        m.commit(i % 2, 103 + i, loss=1.0)
    assert m.stage is Stage.SHL
    m.commit(0, 110, loss=1.0)
    assert m.stage is Stage.DONE and "commit budget" in m.stop_reason
    assert m.commits == 6 and m.commits_of(0) == 4


def test_done_is_final_and_commits_after_it_are_not_counted():
    m = started(max_commits=1)
    m.commit(0, 102)
    assert m.done
    m.commit(1, 103, loss=0.0)
    assert m.commits == 1 and len([t for t in m.transitions if t.to_stage is Stage.DONE]) == 1


def test_external_stop_and_bad_input():
    m = started()
    m.stop(105.0, "user asked")
    assert m.done and m.stop_reason == "user asked"
    with pytest.raises(ValueError, match="rank 2 out of range"):
        m.commit(2, 106.0)
    with pytest.raises(ValueError, match="max_commits"):
        StageConfig(max_commits=0)
    with pytest.raises(ValueError, match="n_ranks"):
        StageMachine(0)


def test_running_loss_round_mean_then_ema():
    rl = RunningLoss(smoothing=0.5)
    assert rl.commit() is None                         # nothing yet
    for v in (1.0, 3.0):
        rl.add(v)
    assert rl.commit() == 2.0                          # first round initialises
    rl.add(float("nan"))                               # skipped
    rl.add(1.0)
    assert rl.commit() == pytest.approx(1.5)           # 0.5 * 2 + 0.5 * 1
    assert rl.commit() == pytest.approx(1.5)           # empty round keeps the value
