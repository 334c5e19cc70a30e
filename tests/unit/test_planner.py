"""ashl.planner: unit tests, the reference's worked example, and hypothesis properties."""

import dataclasses
import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from unittest import mock

from ashl.planner import (bottleneck_steps, rank_steps, AHL, SHL, Plan, PlannerConfig, RankProfile, largest_remainder,
                          load_profile_document, make_plan, payload_fraction, plan_stage,
                          profiles_from_columns, push_seconds, round_local_steps)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "profile.example.json"


def reference_profiles():
    # the worked example of docs/ALGORITHM.md section 3 (made-up times, the authors' formulas)
    return profiles_from_columns(compute_s=[0.2, 0.3, 0.4], push_s=[0.2, 0.3, 0.4],
                                 pull_s=[0.2, 0.3, 0.4], compress_s=[0.01] * 3)


# ------------------------------------------------------------------ worked example


def test_reference_example_dense():
    plan = make_plan(reference_profiles(), PlannerConfig(shl_target_ratio=1.0))
    assert plan.ahl.local_steps == (18, 11, 8)
    assert plan.shl.local_steps == (6, 3, 2)
    assert plan.shl.shares == (Fraction(6, 11), Fraction(3, 11), Fraction(2, 11))
    assert plan.shl.ratios == (1.0, 1.0, 1.0)


def test_reference_example_authors_rules_reproduce_their_table():
    # kappa = 1 and Python's round are the authors' choices; their R = (0.6, 0.4, 0.3)
    cfg = PlannerConfig(shl_target_ratio=0.3, sparse_bytes_factor=1.0, rounding="half_even")
    plan = make_plan(reference_profiles(), cfg)
    assert plan.shl.local_steps == (5, 3, 2)
    assert plan.ahl.local_steps == (18, 11, 8)
    assert plan.shl.shares == (Fraction(1, 2), Fraction(3, 10), Fraction(1, 5))
    assert plan.shl.ratios == pytest.approx((0.6, 0.4, 0.3))


def test_target_ratio_applied_once_and_ahl_uses_dense_push():
    cfg = PlannerConfig(shl_target_ratio=0.1, sparse_bytes_factor=2.0)
    p = RankProfile(compute_s=1.0, push_s=10.0, pull_s=1.0, compress_s=0.5)
    plan = make_plan([p, p], cfg)
    # SHL: compressed push = kappa * r0 * u = 2 s (not r0^2), plus pull and compress
    assert plan.shl.rank_round_s[0] == pytest.approx(2 * 1.0 + 2.0 + 1.0 + 0.5)
    # AHL: dense push and no compression time
    assert plan.ahl.rank_round_s[0] == pytest.approx(8 * 1.0 + 10.0 + 1.0)
    assert plan.ahl.ratios == (1.0, 1.0)
    assert plan.shl.ratios == (0.1, 0.1)


def test_bottleneck_gets_target_ratio_others_fill_leftover():
    cfg = PlannerConfig(shl_target_ratio=0.05)
    slow = RankProfile(compute_s=1.0, push_s=4.0, pull_s=1.0)
    fast_link_slow = RankProfile(compute_s=1.0, push_s=2.0, pull_s=1.0)
    plan = make_plan([slow, fast_link_slow], cfg)
    assert plan.shl.bottleneck == 0
    assert plan.shl.ratios[0] == 0.05
    # same compute, so same H; the faster link affords a larger ratio: 2 * R * 2 = 2 * 0.05 * 4
    assert plan.shl.local_steps == (2, 2)
    assert plan.shl.ratios[1] == pytest.approx(0.1)
    assert plan.shl.idle_fraction[1] == pytest.approx(0.0, abs=1e-12)


def test_leftover_large_enough_for_dense_sends_dense():
    cfg = PlannerConfig(shl_target_ratio=0.1, sparse_bytes_factor=2.0)
    slow = RankProfile(compute_s=1.0, push_s=10.0, pull_s=1.0)
    quick_link = RankProfile(compute_s=1.0, push_s=0.5, pull_s=1.0)
    plan = make_plan([slow, quick_link], cfg)
    assert plan.shl.ratios[1] == 1.0


def test_link_model_predicts_push_and_pull():
    cfg = PlannerConfig(dense_bytes=1_000_000, sparse_bytes_factor=2.0)
    p = RankProfile(compute_s=0.1, latency_s=0.01, bytes_per_s=1e7)
    assert push_seconds(p, 1.0, cfg) == pytest.approx(0.11)
    assert push_seconds(p, 0.1, cfg) == pytest.approx(0.01 + 0.1 * 0.2)
    plan = make_plan([p, p.with_compute(0.05)], cfg)
    assert plan.ahl.local_steps[0] == 8 and plan.ahl.local_steps[1] == 16


def test_payload_fraction_never_exceeds_dense():
    assert payload_fraction(1.0, 2.0) == 1.0
    assert payload_fraction(0.75, 2.0) == 1.0
    assert payload_fraction(0.1, 2.0) == pytest.approx(0.2)


# ---------------------------------------------------------------------- rounding


def test_rounding_rules():
    assert round_local_steps(2.5, "half_even") == 2
    assert round_local_steps(2.5, "half_up") == 3
    assert round_local_steps(2.999, "floor") == 2
    assert round_local_steps(2.9999999999999, "floor") == 3   # float noise is not a step
    assert round_local_steps(8 - 1e-13, "floor") == 8


def test_largest_remainder_is_exact_and_documented():
    shares = (Fraction(1, 3), Fraction(1, 3), Fraction(1, 3))
    assert largest_remainder(shares, 10) == (4, 3, 3)          # ties go to the lower rank
    assert largest_remainder((Fraction(6, 11), Fraction(3, 11), Fraction(2, 11)), 50000) == (27273, 13636, 9091)
    with pytest.raises(ValueError):
        largest_remainder((Fraction(1, 2), Fraction(1, 3)), 10)


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=12), st.integers(0, 10**7))
def test_sample_counts_sum_to_dataset_size(hs, n):
    total = sum(hs)
    shares = tuple(Fraction(h, total) for h in hs)
    counts = largest_remainder(shares, n)
    assert sum(counts) == n
    for c, s in zip(counts, shares):
        assert abs(c - s * n) < 1


# ------------------------------------------------------------------ merge weights


def test_weighting_modes():
    profiles = reference_profiles()
    d = make_plan(profiles, PlannerConfig(weighting="data_share", shl_target_ratio=1.0))
    assert d.shl.merge_weights == d.shl.shares
    u = make_plan(profiles, PlannerConfig(weighting="uniform"))
    assert u.shl.merge_weights == (Fraction(1, 3),) * 3
    f = make_plan(profiles, PlannerConfig(weighting="fednova"))
    shares, hs = f.ahl.shares, f.ahl.local_steps
    h_eff = sum(s * h for s, h in zip(shares, hs))
    for w, s, h in zip(f.ahl.merge_weights, shares, hs):
        assert w == s * h_eff / h
    # a full round of every rank moves the model by h_eff average steps
    assert sum(w * h for w, h in zip(f.ahl.merge_weights, hs)) == h_eff * sum(shares)


def test_share_source_shl_reproduces_authors():
    plan = make_plan(reference_profiles(), PlannerConfig(share_source="shl"))
    assert plan.ahl.shares == plan.shl.shares
    plan = make_plan(reference_profiles(), PlannerConfig(share_source="stage"))
    assert plan.ahl.shares == tuple(Fraction(h, 37) for h in (18, 11, 8))


def test_caps_limit_h_and_show_as_idle():
    fast, slow = RankProfile(0.01, 0.01, 0.01), RankProfile(1.0, 0.01, 0.01)
    plan = make_plan([fast, slow], PlannerConfig(max_h_ahl=20, comm_budget=None))
    assert plan.ahl.local_steps == (20, 8)
    assert plan.ahl.idle_fraction[0] > 0.9


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize("field,value", [("compute_s", 0.0), ("compute_s", -1.0),
                                         ("compute_s", float("nan")), ("push_s", float("inf")),
                                         ("pull_s", 0), ("compress_s", -0.1)])
def test_bad_time_names_rank_and_field(field, value):
    good = dict(compute_s=0.1, push_s=0.1, pull_s=0.1)
    bad = dict(good, **{field: value})
    with pytest.raises(ValueError, match=rf"rank 1.*{field}"):
        make_plan([RankProfile(**good), RankProfile(**bad)])


def test_no_ranks():
    with pytest.raises(ValueError, match="at least one rank"):
        make_plan([])


def test_inconsistent_lengths():
    with pytest.raises(ValueError, match="push_s has 2 entries but compute_s has 3"):
        profiles_from_columns([0.1, 0.2, 0.3], push_s=[0.1, 0.1], pull_s=[0.1] * 3)


def test_missing_push_without_link_model():
    with pytest.raises(ValueError, match="rank 0: push_s is missing"):
        make_plan([RankProfile(compute_s=0.1, pull_s=0.1)])
    with pytest.raises(ValueError, match="dense_bytes"):
        make_plan([RankProfile(compute_s=0.1, latency_s=0.0, bytes_per_s=1e9)])


def test_bad_config():
    with pytest.raises(ValueError, match="k_ahl"):
        PlannerConfig(k_ahl=0)
    with pytest.raises(ValueError, match="weighting"):
        PlannerConfig(weighting="fedavg")
    with pytest.raises(ValueError, match="max_h_shl"):
        PlannerConfig(max_h_shl=1)
    with pytest.raises(ValueError, match="shl_target_ratio"):
        PlannerConfig(shl_target_ratio=1.5)


# ------------------------------------------------------------------ serialisation


def test_plan_json_round_trip_and_frozen():
    plan = make_plan(reference_profiles(), version=3, reason="test")
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert json.loads(plan.to_json())["stages"][SHL]["shares"][0] == "1/2"
    with pytest.raises(AttributeError):
        plan.version = 4


def test_example_profile_document_loads():
    profiles, config, size = load_profile_document(json.loads(EXAMPLE.read_text()))
    plan = make_plan(profiles, config)
    assert sum(plan.sample_counts(size, AHL)) == size
    assert plan.ahl.local_steps[plan.ahl.bottleneck] == config.k_ahl


def test_cli_prints_table():
    env = {"PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-m", "ashl.plan", str(EXAMPLE)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "H(AHL)" in out.stdout and "bottleneck" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "ashl.plan", "/nonexistent.json"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode != 0 and "nonexistent" in bad.stderr


def test_planner_imports_without_torch():
    code = ("import sys; import ashl.planner, ashl.stages, ashl.profiler, ashl.coordinator, ashl.plan; "
            "assert 'torch' not in sys.modules and 'mpi4py' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT / "src")}, timeout=60)
    assert out.returncode == 0, out.stderr


# ----------------------------------------------------------------------- properties

times = st.floats(min_value=1e-4, max_value=10.0, allow_nan=False, allow_infinity=False)
ratios = st.sampled_from([1.0, 0.5, 0.1, 0.01])


@st.composite
def rank_profiles(draw, n=st.integers(1, 8)):
    count = draw(n)
    return [RankProfile(compute_s=draw(times), push_s=draw(times), pull_s=draw(times),
                        compress_s=draw(st.one_of(st.just(0.0), times)))
            for _ in range(count)]


configs = st.builds(PlannerConfig, k_ahl=st.integers(1, 16), k_shl=st.integers(1, 4),
                    shl_target_ratio=ratios, ahl_target_ratio=st.sampled_from([1.0, 0.25]),
                    weighting=st.sampled_from(["data_share", "uniform", "fednova"]))


@settings(max_examples=300, deadline=None)
@given(rank_profiles(), configs)
def test_properties_of_every_stage(profiles, config):
    plan = make_plan(profiles, config)
    for stage in (plan.ahl, plan.shl):
        k = stage.k
        # the bottleneck gets exactly k; nobody gets fewer
        assert stage.local_steps[stage.bottleneck] == k
        assert all(h >= k for h in stage.local_steps)
        # every rank's round is within one of its own steps of the longest, give or take
        # the timing tolerance; none outlasts the bottleneck's by more than that tolerance
        tol = config.floor_tolerance * stage.round_s
        bottleneck_round = stage.rank_round_s[stage.bottleneck]
        for r, p in enumerate(profiles):
            assert stage.round_s - stage.rank_round_s[r] <= (p.compute_s + tol) * (1 + 1e-9)
            assert stage.rank_round_s[r] <= (bottleneck_round + tol) * (1 + 1e-9)
            assert 0 <= stage.idle_fraction[r] < 1
        assert stage.round_s == max(stage.rank_round_s)
        # shares are exact and sum to 1; ratios are in range
        assert sum(stage.shares) == 1
        assert all(isinstance(s, Fraction) and s > 0 for s in stage.shares)
        assert all(stage.target_ratio <= r <= 1 for r in stage.ratios)


@settings(max_examples=200, deadline=None)
@given(rank_profiles(st.integers(2, 8)), configs, st.data())
def test_faster_rank_never_gets_fewer_steps(profiles, config, data):
    # rank i dominates rank j when it is no slower in any measured time
    plan = make_plan(profiles, config)
    for stage in (plan.ahl, plan.shl):
        for i, a in enumerate(profiles):
            for j, b in enumerate(profiles):
                if (a.compute_s <= b.compute_s and a.push_s <= b.push_s and a.pull_s <= b.pull_s
                        and a.compress_s <= b.compress_s):
                    assert stage.local_steps[i] >= stage.local_steps[j]


@settings(max_examples=200, deadline=None)
@given(st.lists(times, min_size=2, max_size=8), times, configs)
def test_faster_compute_same_link_never_fewer_steps(compute, link, config):
    profiles = [RankProfile(compute_s=c, push_s=link, pull_s=link) for c in compute]
    plan = make_plan(profiles, config)
    for stage in (plan.ahl, plan.shl):
        order = sorted(range(len(compute)), key=lambda i: compute[i])
        hs = [stage.local_steps[i] for i in order]
        assert hs == sorted(hs, reverse=True)


@settings(max_examples=200, deadline=None)
@given(rank_profiles(), configs, st.floats(min_value=1e-3, max_value=1e3))
def test_scaling_every_time_leaves_plan_unchanged(profiles, config, scale):
    scaled = [RankProfile(compute_s=p.compute_s * scale, push_s=p.push_s * scale,
                          pull_s=p.pull_s * scale, compress_s=p.compress_s * scale) for p in profiles]
    a, b = make_plan(profiles, config), make_plan(scaled, config)
    for sa, sb in ((a.ahl, b.ahl), (a.shl, b.shl)):
        # a near-tie between two bottleneck candidates may resolve either way; H is the same
        assert sa.local_steps == sb.local_steps
        assert sa.shares == sb.shares
        assert sa.merge_weights == sb.merge_weights
        assert sb.ratios == pytest.approx(sa.ratios, rel=1e-6)
        assert sb.round_s == pytest.approx(sa.round_s * scale, rel=1e-9)
        assert sb.idle_fraction == pytest.approx(sa.idle_fraction, rel=1e-6, abs=1e-9)


# ------------------------------------------------------- the bottleneck's local steps


def _fits(c, cm, k, budget):
    b, steps = rank_steps(c, cm, k)
    rounds = [h * ci + mi for h, ci, mi in zip(steps, c, cm)]
    longest = max(rounds)
    return (cm[b] <= budget * rounds[b]
            and all(longest - r <= budget * longest for r in rounds))


@given(st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=6),
       st.lists(st.floats(0.0, 2.0), min_size=6, max_size=6),
       st.integers(1, 16), st.floats(0.01, 0.9))
def test_bottleneck_takes_the_fewest_steps_that_keep_comm_and_idle_in_budget(c, cm, k_max, budget):
    cm = cm[:len(c)]
    k, b, steps = bottleneck_steps(c, cm, k_max, budget)
    assert 1 <= k <= k_max and steps[b] == k and all(h >= k for h in steps)
    assert (b, steps) == rank_steps(c, cm, k)
    if k < k_max:
        assert _fits(c, cm, k, budget)
    assert not any(_fits(c, cm, fewer, budget) for fewer in range(1, k))   # nothing smaller fits


def test_cheap_communication_means_a_commit_every_step_and_dear_means_k():
    equal = (0.02, 0.02, 0.02)
    assert bottleneck_steps(equal, (0.0,) * 3, 8, 0.1) == (1, 0, (1, 1, 1))
    assert bottleneck_steps(equal, (0.05,) * 3, 8, 0.1)[0] == 8          # never fits: k_AHL
    # 10 ms of communication against 40 ms steps: 3 steps (10 / 130 <= 10 %)
    assert bottleneck_steps((0.04,) * 3, (0.01,) * 3, 8, 0.1)[:2] == (3, 0)
    assert bottleneck_steps(equal, (0.0,) * 3, 8, None)[0] == 8           # the fixed rule


def test_uneven_speeds_take_enough_steps_to_round_well():
    # speeds 1 : 2 : 4 measured a little off: at k = 1 the middle rank would idle half the round
    compute = (0.0050, 0.0101, 0.0200)
    k, b, steps = bottleneck_steps(compute, (1e-5,) * 3, 8, 0.1)
    assert b == 2 and steps[1] / steps[2] >= 1.8 and steps[0] / steps[2] >= 3.6
    assert k == 5 and steps == (20, 9, 5)            # idle at most 10 %: 9 x 10.1 ms of 100 ms


def test_the_plan_follows_the_communication_budget():
    fast_link = [RankProfile(compute_s=c, push_s=1e-5, pull_s=1e-5) for c in (0.01, 0.02, 0.04)]
    plan = make_plan(fast_link)
    assert plan.ahl.k == 1 and plan.ahl.local_steps == (4, 2, 1)
    assert plan.shl.k == 1
    fixed = make_plan(fast_link, PlannerConfig(comm_budget=None))
    assert fixed.ahl.local_steps == (32, 16, 8) and fixed.shl.local_steps == (8, 4, 2)
    # a dense commit fits the budget: SHL is planned dense too (top-k would only lose)
    assert plan.shl.ratios == (1.0, 1.0, 1.0) and plan.shl.target_ratio == 1.0
    assert fixed.shl.ratios[2] == 0.1
    slow_link = [RankProfile(compute_s=c, push_s=0.5, pull_s=0.5) for c in (0.01, 0.02, 0.04)]
    assert make_plan(slow_link).ahl.k == 8 and make_plan(slow_link).shl.k == 2
    assert make_plan(slow_link).shl.ratios[2] == 0.1


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, float("nan"), "0.1"])
def test_comm_budget_must_be_a_fraction(value):
    with pytest.raises(ValueError, match="comm_budget"):
        PlannerConfig(comm_budget=value)


def test_the_authors_rules_in_one_call():
    c = PlannerConfig.authors(shl_target_ratio=0.3)
    assert (c.share_source, c.rounding, c.sparse_bytes_factor, c.comm_budget) == \
        ("shl", "half_even", 1.0, None)
    assert c.shl_target_ratio == 0.3 and PlannerConfig().comm_budget == 0.1


def test_shl_goes_dense_only_where_that_costs_no_commits():
    # dense pushes fit the budget at k = 2 only, top-k ones at k = 1: keep top-k
    profiles = [RankProfile(compute_s=0.01, push_s=0.0015, pull_s=1e-5) for _ in range(3)]
    plan = make_plan(profiles, PlannerConfig(shl_target_ratio=0.1))
    assert plan.shl.k == 1 and plan.shl.ratios == (0.1, 0.1, 0.1)


cheap_links = st.floats(min_value=1e-5, max_value=0.05)


@settings(max_examples=500, deadline=None)
@given(rank_profiles(), configs, st.sampled_from([0.5, 0.1, 0.01]),
       st.sampled_from([0.05, 0.1, 0.3]), st.booleans(), st.data())
def test_going_dense_keeps_the_round_within_the_budget_of_top_k(profiles, config, ratio,
                                                                 budget, overlap, data):
    # Dense commits never come less often than the budget allows against top-k ones.
    # Without overlap that follows from the bottleneck's budget (its round is at most
    # k of its steps / (1 - budget), top-k's at least k of them); with overlap a link-bound
    # dense round gives the bottleneck more than k steps, and the planner must compare
    # the rounds themselves (one rank, c = u = d = 1 s: dense H = 2 in 2 s, top-k 1 in 1.2 s).
    if data.draw(st.booleans()):     # draw cheap links too: dense is planned more often
        profiles = [dataclasses.replace(p, push_s=data.draw(cheap_links),
                                        pull_s=data.draw(cheap_links)) for p in profiles]
    config = dataclasses.replace(config, shl_target_ratio=ratio, comm_budget=budget,
                                 overlap=overlap)
    dense = plan_stage(profiles, config, SHL)
    event(f"dense={dense.target_ratio == 1.0}")
    if dense.target_ratio < 1.0:
        return
    with mock.patch("ashl.planner._dense_fits", return_value=False):
        sparse = plan_stage(profiles, config, SHL)
    assert sparse.target_ratio < 1.0 and sparse.k >= dense.k
    slack = (1 + config.floor_tolerance) / (1 - config.comm_budget)
    assert dense.round_s <= sparse.round_s * slack * (1 + 1e-9)


def test_a_link_bound_dense_round_that_commits_less_often_stays_top_k():
    # the example above: dense commits would come every 2 s, top-k ones every 1.2 s
    one = [RankProfile(compute_s=1.0, push_s=1.0, pull_s=1.0)]
    config = PlannerConfig(k_shl=1, shl_target_ratio=0.1, overlap=True)
    shl = plan_stage(one, config, SHL)
    assert shl.target_ratio == 0.1 and shl.local_steps == (1,) and shl.round_s < 1.3
    assert plan_stage(one, dataclasses.replace(config, overlap=False), SHL).target_ratio == 0.1


# --------------------------------------------------------------------------- DyLU


@given(st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=16), st.integers(1, 64))
def test_dylu_steps_are_the_papers_formula(compute, h):
    from ashl.planner import dylu_steps
    import math
    steps = dylu_steps(compute, h)
    v = [1 / c for c in compute]
    for c, s, vi in zip(compute, steps, v):
        exact = vi / max(v) * h
        assert s == max(1, math.floor(exact)) or (s == math.floor(exact) + 1
                                                   and exact % 1 > 1 - 1e-6)
        assert 1 <= s <= h
    assert steps[compute.index(min(compute))] == h            # the fastest takes H
    order = sorted(range(len(compute)), key=lambda i: compute[i])
    assert all(steps[a] >= steps[b] for a, b in zip(order, order[1:]))   # slower: no more


def test_dylu_steps_on_a_one_two_four_cluster():
    from ashl.planner import dylu_steps
    assert dylu_steps([0.01, 0.02, 0.04], 8) == (8, 4, 2)
    assert dylu_steps([0.01, 0.03], 8) == (8, 2)
    assert dylu_steps([0.01, 1.0], 8) == (8, 1)               # at least one step
    with pytest.raises(ValueError, match="local_steps"):
        dylu_steps([0.01], 0)
    with pytest.raises(ValueError, match="compute_s"):
        dylu_steps([0.01, 0.0], 8)


def test_dylu_plan_shares_follow_the_steps_and_weights_are_one_over_n():
    from ashl.planner import dylu_plan
    profiles = [RankProfile(compute_s=c, push_s=0.001, pull_s=0.001) for c in (0.01, 0.02, 0.04)]
    plan = dylu_plan(profiles, 8, reason="test")
    for stage in (AHL, SHL):
        p = plan.stage(stage)
        assert p.local_steps == (8, 4, 2) and p.ratios == (1.0, 1.0, 1.0)
        assert p.shares == (Fraction(8, 14), Fraction(4, 14), Fraction(2, 14))
        assert p.merge_weights == (Fraction(1, 3),) * 3
        assert p.round_s == pytest.approx(0.082)
    assert Plan.from_json(plan.to_json()) == plan


# ------------------------------------------------------------------ overlapped commits
from ashl.planner import exposed_comm, round_seconds, steps_that_fit  # noqa: E402

seconds = st.floats(1e-4, 2.0, allow_nan=False, allow_infinity=False)


@given(st.integers(1, 64), seconds, seconds)
def test_an_overlapped_round_is_the_longer_of_steps_and_round_trip(h, c, comm):
    assert round_seconds(h, c, comm, overlap=True) == max(h * c, comm)
    assert round_seconds(h, c, comm) == h * c + comm
    assert exposed_comm(h, c, comm, overlap=True) == max(0.0, comm - h * c)
    assert exposed_comm(h, c, comm) == comm


@given(seconds, seconds, seconds, st.booleans())
def test_steps_that_fit_are_the_most_whose_round_fits(round_s, c, comm, overlap):
    h = steps_that_fit(round_s, c, comm, overlap)
    if comm <= round_s:       # a round trip longer than the round: no count of steps fits
        assert h >= 0
        assert round_seconds(h, c, comm, overlap) <= round_s * (1 + 1e-6)
        assert round_seconds(h + 1, c, comm, overlap) > round_s


profiles3 = st.lists(st.tuples(seconds, st.floats(1e-4, 1.0), st.floats(1e-4, 1.0)),
                     min_size=1, max_size=5)


def _profiles(rows):
    return [RankProfile(compute_s=c, push_s=u, pull_s=d) for c, u, d in rows]


@settings(max_examples=80, deadline=None)
@given(profiles3, st.sampled_from([None, 0.1]))
def test_an_overlapped_plan_fits_every_round_in_the_bottleneck_round(rows, budget):
    config = PlannerConfig(overlap=True, comm_budget=budget, shl_target_ratio=1.0,
                           timing_tolerance=0.0)     # its own test, above
    plan = make_plan(_profiles(rows), config)
    for sp in (plan.ahl, plan.shl):
        assert min(sp.local_steps) >= sp.k
        for i, (c, u, d) in enumerate(rows):
            h = sp.local_steps[i]
            assert sp.rank_round_s[i] == max(h * c, u + d)
            # the most steps that fit: one more would make its round the longest
            if h > sp.k:
                assert h * c <= sp.round_s * (1 + 1e-6)
            assert (h + 1) * c > sp.round_s * (1 - 1e-6) or h == sp.k


@settings(max_examples=80, deadline=None)
@given(profiles3, st.integers(1, 8))
def test_overlap_never_makes_the_fixed_k_round_longer(rows, k):
    fixed = dict(comm_budget=None, k_ahl=k, shl_target_ratio=1.0, timing_tolerance=0.0)
    plain = make_plan(_profiles(rows), PlannerConfig(**fixed))
    overlapped = make_plan(_profiles(rows), PlannerConfig(overlap=True, **fixed))
    # T = max_j max(k c_j, C_j) against max_j (k c_j + C_j)
    assert overlapped.ahl.round_s <= plain.ahl.round_s * (1 + 1e-9)
    assert overlapped.ahl.round_s == pytest.approx(
        max(max(k * c, u + d) for c, u, d in rows))
    # and every rank's round trip fits in it, beside its steps
    assert all(u + d <= overlapped.ahl.round_s * (1 + 1e-9) for _, u, d in rows)


def test_speeds_measured_a_hair_off_a_whole_ratio_give_the_whole_ratio():
    # speeds 1 : 1 : 2 : 4 and their links, as profiled on the benchmark's emulated cluster:
    # 0.68003 / 0.17002 = 3.9997, and flooring 4k - 0.001 steps to 4k - 1 idled the fast
    # ranks for a step, so the budget rule went on to k = 5 (rounds 2.5 times longer)
    compute = (0.170021, 0.170025, 0.340026, 0.680029)
    links = (0.1239, 0.1269, 0.2485, 0.4962)
    profiles = [RankProfile(compute_s=c, push_s=u, pull_s=u) for c, u in zip(compute, links)]
    plan = make_plan(profiles, PlannerConfig(overlap=True))
    assert plan.ahl.local_steps == (8, 8, 4, 2)
    assert make_plan(profiles, PlannerConfig(overlap=True, timing_tolerance=0.0)
                     ).ahl.local_steps == (19, 19, 9, 5)
    # both fast ranks have spare link time in SHL: neither is squeezed to the bottleneck's ratio
    assert plan.shl.ratios[:2] == (1.0, 1.0)


@given(st.floats(0.5, 200.0), st.floats(0.0, 0.2))
def test_the_tolerance_adds_at_most_one_step_and_only_within_itself(x, tol):
    h = steps_that_fit(x, 1.0, 0.0, overlap=True, tolerance=tol)
    exact = steps_that_fit(x, 1.0, 0.0, overlap=True)
    assert h in (exact, exact + 1)
    assert h <= x * (1 + tol) * (1 + 1e-9)
    assert steps_that_fit(float(round(x)), 1.0, 0.0, overlap=True, tolerance=tol) == round(x)


def test_the_authors_rules_keep_their_rounding_untouched():
    assert PlannerConfig.authors().floor_tolerance == 0.0
    assert PlannerConfig(rounding="half_even").floor_tolerance == 0.0
    with pytest.raises(ValueError, match="timing_tolerance"):
        PlannerConfig(timing_tolerance=0.5)
    with pytest.raises(ValueError, match="timing_tolerance"):
        PlannerConfig(timing_tolerance=-0.01)


def test_a_link_bound_bottleneck_fills_its_round_with_steps():
    # rank 1: 0.01 s steps behind a 0.5 s round trip; rank 0 computes 0.1 s a step
    rows = [(0.1, 0.05, 0.05), (0.01, 0.25, 0.25)]
    plan = make_plan(_profiles(rows), PlannerConfig(overlap=True, comm_budget=None, k_ahl=2,
                                                    shl_target_ratio=1.0))
    assert plan.ahl.bottleneck == 1 and plan.ahl.round_s == pytest.approx(0.5)
    assert plan.ahl.local_steps == (5, 50)      # both fill the 0.5 s round
    plain = make_plan(_profiles(rows), PlannerConfig(comm_budget=None, k_ahl=2,
                                                     shl_target_ratio=1.0))
    assert plain.ahl.local_steps == (4, 2) and plain.ahl.round_s == pytest.approx(0.52)


def test_overlap_must_be_a_bool():
    with pytest.raises(ValueError, match="overlap"):
        PlannerConfig(overlap=1)


def test_a_plan_with_overlap_round_trips_through_json():
    plan = make_plan(_profiles([(0.1, 0.05, 0.05), (0.2, 0.1, 0.1)]), PlannerConfig(overlap=True))
    assert Plan.from_json(plan.to_json()) == plan


# ------------------------------------------------------- the rank's own work per commit
@given(st.integers(1, 64), seconds, seconds, st.floats(0.0, 1.0), st.booleans())
def test_a_ranks_own_work_on_its_commit_is_never_hidden(h, c, comm, own, overlap):
    # compressing runs on the thread that takes the steps: overlap hides the trip, not it
    assert round_seconds(h, c, comm, overlap, own) == pytest.approx(
        own + round_seconds(h, c, comm, overlap))
    assert exposed_comm(h, c, comm, overlap, own) == pytest.approx(
        own + exposed_comm(h, c, comm, overlap))


@given(seconds, seconds, seconds, st.floats(0.0, 0.5), st.booleans())
def test_steps_that_fit_leave_room_for_the_own_work(round_s, c, comm, own, overlap):
    h = steps_that_fit(round_s, c, comm, overlap, own_s=own)
    if comm + own <= round_s:
        assert round_seconds(h, c, comm, overlap, own) <= round_s * (1 + 1e-6)
        assert round_seconds(h + 1, c, comm, overlap, own) > round_s


def test_compressing_that_costs_more_than_it_saves_is_planned_dense():
    # The homogeneous 50 ms demo as profiled: four equal ranks, a 37 ms dense push and pull,
    # a top-k pack of 18-34 ms on two loaded cores. Planned as if compressing were free and
    # hidden, SHL sent top-k every step; each pack then held its rank for a third of a
    # step and the ranks delivered 71% of the ideal throughput (median of 3 seeds,
    # docs/BENCHMARKS.md).
    free = [RankProfile(compute_s=0.05, push_s=0.037, pull_s=0.037)] * 4
    config = PlannerConfig(overlap=True)
    shl = plan_stage(free, config, SHL)
    assert shl.target_ratio == 0.1 and shl.local_steps == (1, 1, 1, 1)
    measured = [dataclasses.replace(p, compress_s=g) for p, g in zip(free, (0.018, 0.018,
                                                                            0.033, 0.034))]
    shl = plan_stage(measured, config, SHL)
    assert shl.target_ratio == 1.0 and shl.local_steps == (2, 2, 2, 2)
    assert shl.round_s == pytest.approx(0.1)
    # 10 ms would hide behind a 44 ms top-k trip (under 50 ms of steps) if the planner let
    # it; on the rank's own thread it is a fifth of a step every step
    cheap = [dataclasses.replace(p, compress_s=0.01) for p in free]
    shl = plan_stage(cheap, config, SHL)
    assert shl.target_ratio == 1.0 and shl.local_steps == (2, 2, 2, 2)


def test_the_compressing_bottleneck_pays_its_own_work_in_its_round():
    # the benchmark's factor-4 rank: a 0.8 s step, top-k at k = 1, a 30 ms pack
    profiles = [RankProfile(compute_s=c, push_s=u, pull_s=u, compress_s=0.03)
                for c, u in ((0.2, 0.1455), (0.2, 0.1455), (0.4, 0.2935), (0.8, 0.5842))]
    shl = plan_stage(profiles, PlannerConfig(overlap=True), SHL)
    assert shl.local_steps == (4, 4, 2, 1) and shl.bottleneck == 3
    assert shl.round_s == pytest.approx(0.83)
    assert shl.rank_round_s[3] == pytest.approx(0.03 + 0.8)
