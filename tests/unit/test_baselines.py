"""The baselines' pure logic: ADSP's curve fit, reward and commit-rate search; the fixed plan;
the single-stage machine (their real runs: tests/mpi/test_baselines_mpi.py)."""

import math
from fractions import Fraction

import pytest

from ashl.planner import Plan, uniform_plan
from ashl.stages import Stage, StageConfig, StageMachine
from ashl.strategies import STRATEGIES
from ashl.strategies.adsp import CommitRateSearch, adsp_reward, fit_loss_curve


# ------------------------------------------------------------------------ pure logic

def curve(a2, b, c):
    return lambda t: 1.0 / (a2 * t + b) + c


@pytest.mark.parametrize("use_scipy", [True, False])
def test_fit_recovers_the_curve_through_three_points(use_scipy):
    f = curve(2.0, 1.5, 0.1)
    t = [3.0, 4.0, 5.0]
    a2, b, c = fit_loss_curve(t, [f(x) for x in t], use_scipy=use_scipy)
    assert a2 == pytest.approx(2.0, rel=1e-4) and b == pytest.approx(1.5, rel=1e-4)
    assert c == pytest.approx(0.1, abs=1e-5)


@pytest.mark.parametrize("use_scipy", [True, False])
def test_fit_least_squares_on_more_points(use_scipy):
    f = curve(0.5, 2.0, 0.2)
    t = [0.0, 1.0, 2.0, 3.0, 5.0, 8.0]
    a2, b, c = fit_loss_curve(t, [f(x) for x in t], use_scipy=use_scipy)
    for x in (0.5, 4.0, 20.0):
        assert 1 / (a2 * x + b) + c == pytest.approx(f(x), rel=1e-3)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError):
        fit_loss_curve([0, 1], [1, 0.5])
    assert fit_loss_curve([0, 1, 2], [1.0, float("nan"), 0.5]) is None


def test_reward_is_one_over_the_predicted_time_to_the_target():
    a2, b, c = 2.0, 1.0, 0.1
    # 1/(2t + 1) + 0.1 = 0.2 at t = 4.5
    assert adsp_reward((a2, b, c), 0.2) == pytest.approx(1 / 4.5)
    assert adsp_reward((a2, b, c), 0.2) == pytest.approx(a2 / (1 / (0.2 - c) - b))
    assert adsp_reward((a2, b, c), 0.05) == 0.0          # below the asymptote: never
    assert adsp_reward((0.0, b, c), 0.2) == 0.0          # flat
    assert adsp_reward(None, 0.2) == 0.0                 # no fit
    assert adsp_reward((a2, 20.0, c), 0.2) == math.inf   # already below the target


def simulate(search, speed, loss_at, until, dt=0.05, jump_at=None):
    """Feed the search a loss whose progress rate depends on the c_target it chose."""
    p, t, seen = 0.0, 0.0, []
    while t < until:
        c = search.update(t, loss_at(p) * (1.5 if jump_at is not None and t >= jump_at else 1))
        seen.append(c)
        p += speed(c) * dt
        t += dt
    return seen


@pytest.mark.parametrize("use_scipy", [True, False])
def test_search_climbs_while_the_reward_improves_then_settles(use_scipy):
    speed = {1: 1.0, 2: 2.0, 3: 2.6, 4: 2.0, 5: 1.0}.get
    s = CommitRateSearch(1.0, loss_target=0.06, c_max=5, use_scipy=use_scipy)
    simulate(s, speed, lambda p: 1 / (p + 1) + 0.05, until=6.0)
    assert [tr["c_target"] for tr in s.trials] == [1, 2, 3, 4]
    rewards = [tr["reward"] for tr in s.trials]
    assert rewards[0] < rewards[1] < rewards[2] > rewards[3]
    assert s.phase == "run" and s.c_target == 3
    assert s.decisions == [{"at_s": pytest.approx(4.0, abs=0.25), "c_target": 3,
                            "reward": rewards[2], "why": "start"}]
    # each trial: three samples (start = the previous end, middle, end), one period apart
    for tr in s.trials:
        (t0, _), (t1, _), (t2, _) = tr["samples"]
        assert t1 - t0 == pytest.approx(0.5, abs=0.06) and t2 - t0 == pytest.approx(1.0, abs=0.06)


def test_search_stops_at_c_max_and_on_no_improvement():
    s = CommitRateSearch(1.0, loss_target=0.06, c_max=2)
    simulate(s, lambda c: float(c), lambda p: 1 / (p + 1) + 0.05, until=4.0)
    assert [tr["c_target"] for tr in s.trials] == [1, 2] and s.c_target == 2
    s = CommitRateSearch(1.0, loss_target=0.06)
    simulate(s, lambda c: 3.0 - c, lambda p: 1 / (p + 1) + 0.05, until=4.0)
    assert [tr["c_target"] for tr in s.trials] == [1, 2] and s.c_target == 1


def test_search_waits_for_a_loss_and_researches_on_a_jump_or_periodically():
    s = CommitRateSearch(1.0, loss_target=0.06, c_max=3, research_every_s=100.0)
    assert s.update(0.0, None) == 1 and s.phase == "start"
    simulate(s, lambda c: float(c), lambda p: 1 / (p + 1) + 0.05, until=10.0, jump_at=6.0)
    assert s.searches == 2 and "jumped" in s.why
    s = CommitRateSearch(1.0, loss_target=0.06, c_max=2, research_every_s=5.0)
    simulate(s, lambda c: float(c), lambda p: 1 / (p + 1) + 0.05, until=12.0)
    assert s.searches >= 2 and s.why == "periodic search"


def test_uniform_plan_round_trips_and_has_the_fixed_numbers():
    p = uniform_plan(3, 1, Fraction(1))
    assert Plan.from_json(p.to_json()) == p
    for stage in ("AHL", "SHL"):
        sp = p.stage(stage)
        assert sp.local_steps == (1, 1, 1) and sp.ratios == (1.0, 1.0, 1.0)
        assert sp.shares == (Fraction(1, 3),) * 3 and sp.merge_weights == (1, 1, 1)
    assert uniform_plan(4, 8, Fraction(1, 4)).ahl.merge_weights == (Fraction(1, 4),) * 4
    with pytest.raises(ValueError):
        uniform_plan(3, 0, Fraction(1))


def test_single_stage_machine_never_switches_but_still_stops():
    m = StageMachine(2, StageConfig(switch=False, ahl_max_commits=2, max_commits=10))
    m.begin_training(0.0)
    for i in range(9):
        m.commit(i % 2, float(i), loss=0.01)      # below switch_loss, past the AHL budget
        assert m.stage is Stage.AHL
    m.commit(1, 9.0, loss=0.01)
    assert m.done and m.stop_reason.startswith("commit budget")
    m = StageMachine(1, StageConfig(switch=False))
    m.resume(Stage.SHL, 0.0, reason="fixed plan")
    assert m.stage is Stage.SHL and m.transitions[-1].reason == "fixed plan"


def test_every_baseline_is_registered():
    assert {"bsp", "localsgd", "ssp", "asp", "adsp"} <= set(STRATEGIES)
