"""Fault tolerance without MPI: plans for the survivors of a lost rank (planner.embed_plan,
Coordinator.lose / rejoin), the global loss without them, the parameter server's roll of
live ranks (lose, silence, admit), the job's exit status (ashl.run), and the options that
refuse a fault-tolerant run of a synchronous strategy. The wire (ZeroMQ) is
tests/unit/test_transport.py."""

import json
import math
import subprocess
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ashl import run
from ashl.cli import OptionError, check_fault_tolerant
from ashl.coordinator import CommitReport, Coordinator, DriftConfig
from ashl.planner import (Plan, PlannerConfig, RankProfile, embed_plan, make_plan,
                          uniform_plan)
from ashl.protocol import DType, Flag, Header, Kind
from ashl.server import JoinRefused, LostRank, ParameterServer
from ashl.stages import Stage, StageConfig, StageMachine
from ashl.strategies import FAULT_TOLERANT, STRATEGIES
from ashl.torch.exit import LOST_RANKS_STATUS
from ashl.torch.optimizer import _strategy_options
from ashl.torch.sampler import HeterogeneousSampler, padded_counts, shares_to_counts

N = 10                       # elements of the servers' global model
SYNCHRONOUS = ("bsp", "ashl-sync", "localsgd", "diloco")
FIXED_K = PlannerConfig(comm_budget=None)   # H (32, 16, 8) for PROFILES: easy to read


class Clock:
    """A clock that moves only when the test moves it."""

    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def profiles(compute=(0.01, 0.02, 0.04), link=0.001):
    return [RankProfile(compute_s=c, push_s=link, pull_s=link) for c in compute]


# ------------------------------------------------------------------ planner.embed_plan

positive = st.floats(1e-3, 10.0, allow_nan=False, allow_infinity=False)
rank_profile = st.builds(RankProfile, compute_s=positive, push_s=positive, pull_s=positive,
                         compress_s=st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
configs = st.sampled_from([PlannerConfig(), FIXED_K, PlannerConfig.authors(),
                           PlannerConfig(weighting="fednova"), PlannerConfig(weighting="uniform")])


@st.composite
def survivors(draw):
    ps = draw(st.lists(rank_profile, min_size=1, max_size=6))
    # any non-empty subset, in any order: index j of the sub plan is rank live[j]
    live = draw(st.lists(st.integers(0, len(ps) - 1), min_size=1, max_size=len(ps), unique=True))
    return ps, live, draw(configs)


STAGE_FIELDS = ("local_steps", "ratios", "shares", "merge_weights", "rank_round_s",
                "idle_fraction")
FILL = {"local_steps": 0, "ratios": 1.0, "shares": 0, "merge_weights": 0, "rank_round_s": 0.0,
        "idle_fraction": 0.0}


@given(survivors(), st.integers(1, 100), st.text(max_size=20))
@settings(max_examples=60)
def test_embed_plan_puts_each_survivor_at_its_rank_and_nothing_elsewhere(case, version, reason):
    ps, live, cfg = case
    sub = make_plan([ps[r] for r in live], cfg)
    plan = embed_plan(sub, live, ps, version=version, reason=reason)
    assert plan.n_ranks == len(ps) and plan.profiles == tuple(ps)
    assert (plan.version, plan.reason, plan.config) == (version, reason, sub.config)
    for name in ("AHL", "SHL"):
        got, want = plan.stage(name), sub.stage(name)
        assert (got.stage, got.k, got.target_ratio, got.round_s) == (
            want.stage, want.k, want.target_ratio, want.round_s)
        for field in STAGE_FIELDS:
            values = getattr(got, field)
            assert len(values) == len(ps)
            for r in range(len(ps)):
                expected = (getattr(want, field)[live.index(r)] if r in live else FILL[field])
                assert values[r] == expected, (name, field, r)
        assert sum(got.shares) == 1                         # exactly: Fractions
        assert got.bottleneck == live[want.bottleneck] and got.bottleneck in live
        assert all(got.local_steps[r] >= 1 for r in live)
        counts = got.sample_counts(1000)
        assert sum(counts) == 1000 and all(counts[r] == 0 for r in range(len(ps)) if r not in live)
    assert Plan.from_json(plan.to_json()) == plan           # it travels as any plan


@given(st.lists(rank_profile, min_size=1, max_size=6), configs)
@settings(max_examples=40)
def test_embed_plan_of_every_rank_is_the_plan_itself(ps, cfg):
    full = make_plan(ps, cfg)
    plan = embed_plan(full, range(len(ps)), ps, version=7, reason="all back")
    assert plan.ahl == full.ahl and plan.shl == full.shl
    assert plan.profiles == full.profiles and plan.version == 7 and plan.reason == "all back"


@pytest.mark.parametrize("live", [[0], [0, 1, 2], [0, 0], [0, 3], [-1, 0], [], [3, 4]],
                         ids=["too few", "too many", "twice", "past the end", "negative",
                             "none", "outside"])
def test_embed_plan_refuses_live_ranks_that_do_not_fit(live):
    ps = profiles()
    sub = make_plan(ps[:2], FIXED_K)
    with pytest.raises(ValueError, match="live ranks"):
        embed_plan(sub, live, ps, version=2)


# ------------------------------------------------------------ Coordinator.lose / rejoin


def coordinator(drift=None, compute=(0.01, 0.02, 0.04), stage=None):
    clock = Clock()
    c = Coordinator(len(compute), FIXED_K, stage or StageConfig(),
                    drift or DriftConfig(enabled=False), clock)
    c.plan_from_profiles(profiles(compute))
    return c, clock


def report(c, clock, rank, step_s=None, loss=1.0):
    clock.t += 0.01
    return c.on_commit(CommitReport(rank=rank, plan_version=c.plan.version, step_s=step_s,
                                    loss=loss))


def test_lose_replans_among_the_survivors_and_logs_it():
    c, _ = coordinator()
    before = c.plan
    events = len(c.events)
    c.lose(1, "rank 1 lost: test")
    ps = list(before.profiles)
    expected = embed_plan(make_plan([ps[0], ps[2]], FIXED_K), [0, 2], ps, version=2,
                          reason="rank 1 lost: test")
    assert c.plan == expected
    assert c.plan.version == before.version + 1 and c.live == {0, 2}
    for stage in (c.plan.ahl, c.plan.shl):
        assert stage.local_steps[1] == 0 and stage.shares[1] == 0 and stage.merge_weights[1] == 0
        assert sum(stage.shares) == 1 and stage.bottleneck != 1
    new = c.events[events:]
    assert [e.kind for e in new] == ["plan"]
    assert new[0].plan_version == 2 and new[0].reason == "rank 1 lost: test"
    # the directive hands the survivors the new plan
    d = c.directive(rank_plan_version=1)
    assert d.plan is c.plan and d.plan_version == 2


def test_the_global_loss_waits_only_for_the_survivors():
    c, clock = coordinator()
    report(c, clock, 0, loss=1.0)
    report(c, clock, 1, loss=3.0)
    assert c.global_loss is None               # rank 2 has never reported
    c.lose(2, "gone")
    shares = c.plan.ahl.shares
    assert shares[2] == 0
    assert c.global_loss == pytest.approx(float(shares[0] * 1 + shares[1] * 3))


def test_lose_of_an_unknown_or_already_lost_rank_is_a_no_op():
    c, _ = coordinator()
    c.lose(2, "first")
    plan, events, live = c.plan, list(c.events), set(c.live)
    for rank in (2, 7, -1):
        c.lose(rank, "again")
        assert c.plan is plan and c.events == events and c.live == live


def test_losing_every_rank_leaves_the_last_plan():
    c, _ = coordinator()
    c.lose(0, "a")
    c.lose(1, "b")
    plan = c.plan
    c.lose(2, "c")                              # nobody left to plan for
    assert c.live == set() and c.plan is plan


def test_lose_before_any_plan_only_shrinks_the_live_set():
    c = Coordinator(3, FIXED_K, clock=Clock())
    c.lose(1, "gone before profiling")
    assert c.live == {0, 2} and c.plan is None and c.events == []


def test_plan_for_is_how_the_survivors_are_planned():
    c, _ = coordinator()
    ps = list(c.plan.profiles)
    calls = []

    def plan_for(subset):
        calls.append(list(subset))
        return uniform_plan(len(subset), 4, Fraction(1, len(subset)))

    c.plan_for = plan_for
    c.lose(1, "gone")
    assert calls == [[ps[0], ps[2]]]
    assert c.plan.ahl.local_steps == (4, 0, 4) and c.plan.shl.local_steps == (4, 0, 4)
    assert c.plan.ahl.merge_weights == (Fraction(1, 2), 0, Fraction(1, 2))
    assert c.plan.profiles == tuple(ps)          # the run's profiles, not the placeholders
    c.rejoin(1, 0.5, "back")
    assert calls[-1] == [ps[0], ps[1].with_compute(0.5), ps[2]]
    assert c.plan.ahl.local_steps == (4, 4, 4)


def test_drift_ignores_lost_ranks():
    c, clock = coordinator(drift=DriftConfig(cooldown_commits=0, cooldown_s=0.0))
    c.lose(2, "gone")
    assert c.plan.version == 2
    for _ in range(5):                  # the lost rank's late reports: 5 x its planned step
        report(c, clock, 2, step_s=0.2)
        report(c, clock, 0, step_s=0.01)
    assert all(d.rank != 2 for d in c.drifts())
    assert c.plan.version == 2          # nothing moved
    for _ in range(3):                  # a survivor that slowed down still re-plans
        report(c, clock, 1, step_s=0.04)
    assert c.plan.version == 3 and c.plan.reason.startswith("drift")
    assert c.plan.profiles[1].compute_s == pytest.approx(0.04)
    assert c.plan.profiles[2] == profiles()[2]
    assert c.plan.ahl.local_steps[2] == 0 and c.plan.shl.shares[2] == 0
    assert all(d.rank != 2 for d in c.drifts())


def test_rejoin_restores_the_rank_with_its_new_compute_time():
    c, _ = coordinator()
    first = c.plan
    c.lose(1, "gone")
    events = len(c.events)
    c.rejoin(1, 0.005, "a replacement took rank 1's slot")
    assert c.live == {0, 1, 2} and c.plan.version == 3
    assert c.plan.profiles[1] == first.profiles[1].with_compute(0.005)
    assert c.plan.profiles[0] == first.profiles[0] and c.plan.profiles[2] == first.profiles[2]
    full = make_plan(c.plan.profiles, FIXED_K)
    assert c.plan.ahl == full.ahl and c.plan.shl == full.shl
    assert c.plan.ahl.local_steps[1] > first.ahl.local_steps[1]   # faster than before
    assert [e.kind for e in c.events[events:]] == ["plan"]
    assert c.events[-1].reason == "a replacement took rank 1's slot"


def test_rejoin_of_a_live_rank_or_before_a_plan_raises():
    c, _ = coordinator()
    with pytest.raises(ValueError, match="not a lost rank"):
        c.rejoin(1, 0.01, "never lost")
    assert c.plan.version == 1
    bare = Coordinator(3, clock=Clock())
    bare.lose(1, "gone")
    with pytest.raises(ValueError, match="not a lost rank"):
        bare.rejoin(1, 0.01, "no plan yet")


@pytest.mark.parametrize("rank,compute_s", [(7, 0.01), (1, 0.0), (1, float("nan"))],
                         ids=["no such rank", "zero compute", "nan compute"])
def test_a_refused_rejoin_changes_nothing(rank, compute_s):
    c, _ = coordinator()
    c.lose(1, "gone")
    plan = c.plan
    with pytest.raises(ValueError):
        c.rejoin(rank, compute_s, "refused")
    assert c.live == {0, 2} and c.plan is plan


# ------------------------------------------------------------ StageMachine.global_loss


def test_a_rank_without_a_share_does_not_hold_the_global_loss_back():
    m = StageMachine(3)
    m.set_weights([Fraction(1, 2), Fraction(1, 2), Fraction(0)])
    m.commit(0, 0.0, 1.0)
    assert m.global_loss is None               # rank 1 has a share and has not reported
    m.commit(1, 0.0, 3.0)
    assert m.global_loss == 2.0                # rank 2 never reported: ignored
    m.commit(2, 0.0, 100.0)
    assert m.global_loss == 2.0                # and what it reports does not count


@given(st.lists(st.tuples(st.integers(0, 5), st.one_of(st.none(), st.floats(-1e6, 1e6))),
                min_size=1, max_size=8).filter(lambda xs: any(w for w, _ in xs)))
def test_global_loss_is_the_share_weighted_mean_of_the_ranks_with_a_share(ranks):
    m = StageMachine(len(ranks))
    m.set_weights([Fraction(w) for w, _ in ranks])
    for r, (_, loss) in enumerate(ranks):
        if loss is not None:
            m.commit(r, 0.0, loss)
    total = sum(w for w, _ in ranks)
    if any(loss is None for w, loss in ranks if w > 0):
        assert m.global_loss is None
    else:
        want = sum(Fraction(w, total) * Fraction(loss) for w, loss in ranks if w > 0)
        assert m.global_loss == pytest.approx(float(want), rel=1e-12, abs=1e-12)


def test_weights_that_sum_to_nothing_are_refused():
    m = StageMachine(2)
    with pytest.raises(ValueError, match="positive"):
        m.set_weights([0, 0])


# ----------------------------------------------------------- ParameterServer: lost ranks


def make_server(n=3, stage=Stage.AHL, bound=3, silence_s=None, silence_rounds=3.0, rank=0,
                **stage_kw):
    clock = Clock()
    coord = Coordinator(n, FIXED_K, StageConfig(switch_loss=-1.0, **stage_kw),
                        DriftConfig(enabled=False), clock)
    ps = profiles((0.01, 0.02, 0.04, 0.03, 0.05)[:n])
    if stage == Stage.SHL:
        coord.start(make_plan(ps, FIXED_K), Stage.SHL, "a test in SHL")
    else:
        coord.plan_from_profiles(ps)
    return ParameterServer(torch.zeros(N), n, coord, rank=rank, bound=bound, silence_s=silence_s,
                           silence_rounds=silence_rounds, clock=clock)


def dense(rank, value=1.0, stage=Stage.AHL, commit=0, base=0, flags=Flag(0)):
    payload = torch.full((N,), value, dtype=torch.float32)
    h = Header(kind=Kind.DENSE_DELTA, rank=rank, stage=stage, commit=commit, base_version=base,
               plan_version=1, dtype=DType.FLOAT32, numel=N, flags=flags, step_s=0.01, loss=1.0)
    return h, payload.view(torch.uint8)


def test_lose_records_what_the_rank_contributed_and_replans():
    s = make_server()
    clock, coord = s.clock, s.coordinator
    clock.t += 2.0
    s.handle(*dense(1))
    s.handle(*dense(1, commit=1))
    clock.t += 3.0
    version = coord.plan.version
    assert s.lose(1, "its connection closed") == []
    assert s.stats.lost == [LostRank(rank=1, at_s=pytest.approx(5.0), why="its connection closed",
                                     commits=2, merged=2)]
    assert s.live == {0, 2} and s.lost_ranks == {1} and coord.live == {0, 2}
    assert coord.plan.version == version + 1
    assert coord.plan.ahl.local_steps[1] == 0 and coord.plan.ahl.merge_weights[1] == 0
    assert s.weight(1, Stage.AHL) == 0.0
    assert "rank 1 lost: its connection closed" in coord.events[-1].reason
    assert torch.equal(s.model, torch.full((N,), 2 * float(
        make_plan(profiles(), FIXED_K).ahl.merge_weights[1])))   # what it merged stays
    d = s.stats.to_dict()
    assert d["lost"] == [{"rank": 1, "at_s": pytest.approx(5.0), "why": "its connection closed",
                          "commits": 2, "merged": 2}]
    json.dumps(d["lost"])


def test_lose_never_drops_the_servers_rank_nor_a_rank_twice():
    s = make_server(rank=2)
    assert s.lose(2, "the server itself") == [] and 2 in s.live
    s.lose(1, "gone")
    version = s.coordinator.plan.version
    assert s.lose(1, "gone again") == [] and s.lose(9, "no such rank") == []
    assert [x.rank for x in s.stats.lost] == [1] and s.coordinator.plan.version == version


def test_a_rank_that_finished_is_not_lost():
    s = make_server()
    s.handle(*dense(2, flags=Flag.FINAL))
    assert 2 not in s.live and 2 in s.left
    assert s.lose(2, "its connection closed after it finished") == []
    assert s.stats.lost == [] and s.coordinator.live == {0, 1, 2}
    (r,) = s.handle(*dense(2))                         # not dropped: STOP without DROPPED
    assert r.header.flags & Flag.STOP and not r.header.flags & Flag.DROPPED


def test_lose_releases_the_ranks_the_lost_one_held_back():
    s = make_server(stage=Stage.SHL, bound=1)
    assert len(s.handle(*dense(0, stage=Stage.SHL))) == 1
    assert len(s.handle(*dense(1, stage=Stage.SHL))) == 1
    assert s.handle(*dense(1, stage=Stage.SHL, commit=1)) == []   # 2 ahead of rank 2's 0
    assert set(s.waiting) == {1}
    (r,) = s.lose(2, "silent")
    assert r.dest == 1 and not s.waiting
    assert r.header.flags & Flag.ACCEPTED and r.header.commit == 1       # merged at once
    assert not r.header.flags & (Flag.STOP | Flag.DROPPED)
    assert s.coordinator.plan.version == 2 and s.coordinator.plan.shl.local_steps[2] == 0


def test_losing_a_waiting_rank_forgets_its_reply():
    s = make_server(stage=Stage.SHL, bound=0)
    assert s.handle(*dense(1, stage=Stage.SHL)) == []
    assert s.lose(1, "gone while held back") == [] and not s.waiting


def test_a_dropped_ranks_commit_is_not_merged_and_it_is_told_so():
    s = make_server()
    s.handle(*dense(0))
    s.lose(2, "silent")
    model, version, merged = s.model.clone(), s.version, s.stats.merged
    commits = s.coordinator.machine.commits
    (r,) = s.handle(*dense(2, value=5.0))
    assert r.dest == 2 and r.header.kind == Kind.REPLY
    assert r.header.flags & (Flag.STOP | Flag.DROPPED) == Flag.STOP | Flag.DROPPED
    assert not r.header.flags & Flag.ACCEPTED
    assert torch.equal(s.model, model) and s.version == version
    assert s.stats.merged == merged and s.stats.merged_by[2] == 0
    assert s.coordinator.machine.commits == commits    # nor reported to the coordinator


def test_a_loss_after_the_end_is_recorded_without_a_replan():
    s = make_server()
    s.stop("target reached")
    version = s.coordinator.plan.version
    s.lose(1, "gone at the end")
    assert [x.rank for x in s.stats.lost] == [1] and s.coordinator.plan.version == version


# ------------------------------------------------------------ ParameterServer: silence


def commit_every(s, rank, seconds, times=2):
    """`rank` commits `times` times, `seconds` apart (its rounds, as the server sees them)."""
    for _ in range(times):
        s.clock.t += seconds
        s.handle(*dense(rank))


def limit(s, rank):
    return max(s.silence_s, s.silence_rounds * max(s.rounds[rank]))


@pytest.mark.parametrize("silence_s", [0.01, 100.0], ids=["rounds decide", "seconds decide"])
def test_silent_lists_the_ranks_heard_from_too_long_ago(silence_s):
    s = make_server(silence_s=silence_s)
    s.begin()
    for rank, seconds in ((0, 0.1), (1, 0.2), (2, 0.4)):
        commit_every(s, rank, seconds)
    lim = [limit(s, r) for r in (1, 2)]
    assert lim == ([100.0] * 2 if silence_s == 100.0 else [pytest.approx(0.6), pytest.approx(1.2)])
    t0 = s.last_heard[1] = s.last_heard[2] = s.clock.t
    s.clock.t = t0 + 0.99 * min(lim)
    assert s.silent() == []
    s.clock.t = t0 + 1.01 * max(lim)
    silent = s.silent()
    assert [r for r, _ in silent] == [1, 2]               # never the server's own rank
    assert all("silent for" in why for _, why in silent)


@given(st.floats(0.01, 50.0), st.floats(0.5, 10.0),
       st.lists(st.floats(0.01, 20.0), min_size=3, max_size=3), st.floats(0.0, 500.0))
@settings(max_examples=50)
def test_silence_is_measured_against_each_ranks_own_rounds(silence_s, rounds, gaps, later):
    s = make_server(silence_s=silence_s, silence_rounds=rounds)
    s.begin()
    for rank, gap in enumerate(gaps):
        commit_every(s, rank, gap)
    s.clock.t += later
    want = [r for r in (1, 2) if s.clock.t - s.last_heard[r] > limit(s, r)]
    assert [r for r, _ in s.silent()] == want


def test_a_rank_whose_rounds_were_not_seen_yet_is_left_to_the_transport():
    s = make_server(silence_s=1.0)
    s.begin()
    s.clock.t += 1e6           # no commit yet (the baselines' plans know no real round)
    assert s.silent() == []
    s.handle(*dense(1))        # one commit: its round is not known yet either
    s.clock.t += 1e6
    assert s.silent() == []


def test_no_silence_limit_lists_nobody_and_a_stopped_run_still_watches():
    s = make_server()
    s.clock.t += 1e6
    assert s.silent() == []
    s = make_server(silence_s=1.0)
    s.begin()
    commit_every(s, 1, 0.1)
    s.stop("over")             # a rank hung before its last commit must not hold the end
    s.clock.t += 1e6
    assert [r for r, _ in s.silent()] == [1]


def test_a_rank_released_from_a_wait_starts_its_silence_anew():
    s = make_server(stage=Stage.SHL, bound=0, silence_s=1.0)
    s.begin()
    for rank in (0, 1, 2):
        commit_every(s, rank, 0.1, times=1)
    assert s.handle(*dense(1, stage=Stage.SHL)) == []      # waits for ranks 0 and 2
    s.clock.t += 100.0                                      # held back a long time
    assert 1 not in [r for r, _ in s.silent()]
    s.handle(*dense(0, stage=Stage.SHL))
    released = s.handle(*dense(2, stage=Stage.SHL))
    assert 1 in [r.dest for r in released]
    s.clock.t += 0.5                                        # just after its reply
    assert 1 not in [r for r, _ in s.silent()]


def test_tick_drops_the_silent_ranks_and_releases_whom_they_held_back():
    s = make_server(stage=Stage.SHL, bound=0, silence_s=1.0)
    s.begin()
    for rank in (0, 1, 2):
        commit_every(s, rank, 0.1)
    assert len(s.handle(*dense(0, stage=Stage.SHL))) == 0    # held back by ranks 1 and 2
    assert len(s.handle(*dense(1, stage=Stage.SHL))) == 0     # held back by rank 2
    assert set(s.waiting) == {0, 1}
    s.clock.t += 1.5                                           # rank 2 said nothing
    replies = s.tick()
    assert sorted(r.dest for r in replies) == [0, 1] and not s.waiting
    assert all(r.header.flags & Flag.ACCEPTED for r in replies)
    assert s.live == {0, 1} and [x.rank for x in s.stats.lost] == [2]
    assert "silent" in s.stats.lost[0].why
    assert s.coordinator.plan.version == 2
    assert s.tick() == [] and len(s.stats.lost) == 1


# ------------------------------------------------------------ ParameterServer: admit


def join(compute_s=0.03, numel=N, **kw):
    return {"compute_s": compute_s, "numel": numel, "host": "spare", "strategy": "ashl", **kw}


def test_admit_refuses_when_no_rank_was_lost():
    s = make_server()
    with pytest.raises(JoinRefused, match="no rank has been lost"):
        s.admit(join())
    assert issubclass(JoinRefused, ValueError)


def test_admit_gives_the_lowest_lost_slot_until_none_is_left():
    s = make_server(n=4)
    s.lose(3, "a")
    s.lose(1, "b")
    assert s.admit(join()) == 1
    assert s.admit(join()) == 3
    assert s.live == {0, 1, 2, 3} and s.coordinator.live == {0, 1, 2, 3}
    with pytest.raises(JoinRefused, match="no rank has been lost"):
        s.admit(join())


def test_admit_refuses_once_the_run_is_over():
    s = make_server()
    s.lose(1, "gone")
    s.stop("over")
    with pytest.raises(JoinRefused, match="over"):
        s.admit(join())
    assert 1 not in s.live


@pytest.mark.parametrize("request_", [
    join(numel=N + 1), {"compute_s": 0.03}, join(compute_s=0), join(compute_s=-1.0),
    join(compute_s=math.nan), join(compute_s=math.inf), join(compute_s=None),
    join(compute_s="0.03"), {"numel": N}],
    ids=["other model", "no numel", "zero", "negative", "nan", "inf", "none", "text",
         "no compute"])
def test_admit_refuses_a_bad_request_and_changes_nothing(request_):
    s = make_server()
    s.lose(2, "gone")
    version, live = s.coordinator.plan.version, set(s.live)
    with pytest.raises(JoinRefused):
        s.admit(request_)
    assert s.live == live and s.coordinator.live == live
    assert s.coordinator.plan.version == version


def test_an_admitted_replacement_is_live_undropped_and_its_slot_keeps_counting():
    s = make_server()
    for c in range(2):
        s.handle(*dense(2, commit=c))
    s.lose(2, "gone")
    (r,) = s.handle(*dense(2, commit=2))            # the old process, late
    assert r.header.flags & Flag.DROPPED and s.stats.merged_by[2] == 2
    version = s.coordinator.plan.version
    s.clock.t += 7.0
    assert s.admit(join(compute_s=0.005)) == 2
    plan = s.coordinator.plan
    assert 2 in s.live and 2 not in s.left and s.last_heard[2] == s.clock.t
    assert plan.version == version + 1 and plan.profiles[2].compute_s == 0.005
    assert plan.ahl.local_steps[2] > 0 and plan.ahl.merge_weights[2] > 0
    assert s.lost_ranks == {2}                       # the record stays
    (r,) = s.handle(*dense(2, commit=0))
    assert r.header.flags & Flag.ACCEPTED
    assert not r.header.flags & (Flag.DROPPED | Flag.STOP)
    assert s.stats.merged_by[2] == 3 and sum(s.stats.merged_by) == s.stats.merged


def test_a_replacement_that_finishes_is_not_told_it_was_dropped():
    s = make_server()
    s.lose(2, "gone")
    assert s.admit(join()) == 2
    (r,) = s.handle(*dense(2, flags=Flag.FINAL))
    assert r.header.flags & Flag.ACCEPTED and r.header.flags & Flag.STOP
    assert 2 in s.left                                 # it left normally: final model due
    assert not r.header.flags & Flag.DROPPED


def test_the_slot_of_a_replacement_that_finished_is_not_offered_again():
    s = make_server()
    s.lose(2, "gone")
    assert s.admit(join()) == 2
    s.handle(*dense(2, flags=Flag.FINAL))
    assert s.live == {0, 1} and 2 in s.left
    with pytest.raises(JoinRefused):
        s.admit(join())
    assert s.live == {0, 1} and 2 in s.left


def test_an_admitted_replacement_starts_level_with_the_slowest_rank_in_shl():
    s = make_server(stage=Stage.SHL, bound=1)
    for c in range(2):
        s.handle(*dense(0, stage=Stage.SHL, commit=c))
        s.handle(*dense(1, stage=Stage.SHL, commit=c))
    s.lose(2, "gone")
    assert s.admit(join()) == 2
    assert s.shl_commits[2] == 2 and s.slowest_shl() == 2
    assert len(s.handle(*dense(0, stage=Stage.SHL, commit=2))) == 1   # no wait for the newcomer


def test_silence_of_a_replacement_counts_from_its_admission():
    s = make_server(silence_s=1.0)
    s.begin()
    s.lose(2, "gone")
    s.clock.t += 100.0
    s.handle(*dense(1))
    assert s.admit(join()) == 2
    assert not s.rounds[2] and s.last_heard[2] == s.clock.t   # the old occupant's rounds gone
    s.clock.t += 1e6           # its rounds are not known yet: left to the transport
    assert 2 not in [r for r, _ in s.silent()]


ops = st.one_of(
    st.tuples(st.just("commit"), st.integers(0, 3), st.booleans(), st.booleans()),
    st.tuples(st.just("lose"), st.integers(0, 3)),
    st.tuples(st.just("admit")))


@given(st.lists(ops, max_size=40))
@settings(max_examples=60)
def test_merged_by_adds_up_to_merged(sequence):
    s = make_server(n=4)
    accepted = [0] * 4
    for op in sequence:
        if op[0] == "commit":
            _, rank, nonfinite, final = op
            h, payload = dense(rank, value=math.nan if nonfinite else 1.0,
                               flags=Flag.FINAL if final else Flag(0))
            live = rank in s.live
            (r,) = s.handle(h, payload)
            assert r.dest == rank
            assert bool(r.header.flags & Flag.ACCEPTED) == (live and not nonfinite)
            assert bool(r.header.flags & Flag.DROPPED) == (rank in s.vacant)
            accepted[rank] += bool(r.header.flags & Flag.ACCEPTED)
        elif op[0] == "lose":
            s.lose(op[1], "gone")
        else:
            try:
                s.admit(join())
            except JoinRefused:
                pass
        assert sum(s.stats.merged_by) == s.stats.merged == s.version
        assert s.stats.merged_by == accepted
        assert 0 in s.live or 0 in s.left
        for lost in s.stats.lost:
            assert lost.merged <= s.stats.merged_by[lost.rank]
        assert s.coordinator.live >= s.live


# ----------------------------------------------------------------------- ashl.run


def record(rank, status=0, size=3, lost=()):
    return {"rank": rank, "size": size, "status": status, "lost": list(lost)}


@pytest.mark.parametrize("launcher", [0, 1, 137])
def test_without_statuses_the_launcher_decides(launcher):
    assert run.job_status(launcher, {}) == (launcher, [])


@pytest.mark.parametrize("launcher", [0, 1, 2, 137])
def test_every_rank_ending_well_gives_the_launchers_status(launcher):
    statuses = {r: record(r) for r in range(3)}
    assert run.job_status(launcher, statuses) == (max(launcher, 0), [])


def test_a_rank_without_a_status_gives_3_and_is_named():
    status, notes = run.job_status(0, {0: record(0), 2: record(2)})
    assert status == LOST_RANKS_STATUS == 3
    assert any("rank(s) 1 left no exit status" in n for n in notes)
    status, notes = run.job_status(5, {0: record(0)})
    assert status == 5                                   # a worse launcher status stays
    assert any("rank(s) 1, 2 left no exit status" in n for n in notes)


def test_a_failed_rank_outranks_lost_ranks():
    statuses = {0: record(0, LOST_RANKS_STATUS, lost=[2]), 1: record(1, 7)}
    status, notes = run.job_status(0, statuses)
    assert status == 7
    assert any("rank 1 exited with status 7" in n for n in notes)
    assert any("rank(s) 2 left no exit status" in n for n in notes)
    assert any("lost rank(s) 2" in n for n in notes)


def test_a_rank_the_run_declared_lost_is_not_a_failure_of_the_run():
    """Cut off and dropped, a rank may still exit, with a failure (it then lost the server):
    that is the loss the survivors report (status 3), not the run's failure."""
    statuses = {0: record(0, 3, lost=[1]), 1: record(1, 1), 2: record(2, 3, lost=[1])}
    assert run.job_status(0, statuses) == (
        3, ["the run lost rank(s) 1 and went on without them"])


def test_ranks_that_went_on_without_others_give_3_and_name_them():
    statuses = {0: record(0, 3, lost=[1, 3], size=4), 1: record(1, size=4),
                2: record(2, 3, lost=[3], size=4), 3: record(3, size=4)}
    status, notes = run.job_status(0, statuses)
    assert status == 3
    assert notes == ["the run lost rank(s) 1, 3 and went on without them"]


@given(st.dictionaries(st.integers(0, 5), st.sampled_from([0, 1, 3, 9, None]), max_size=6),
       st.integers(0, 255))
def test_job_status_rules(ranks, launcher):
    statuses = {r: {"rank": r, "size": 6, "status": s, "lost": []} for r, s in ranks.items()}
    status, notes = run.job_status(launcher, statuses)
    failed = [s for s in ranks.values() if s not in (0, 3, None)]
    if not statuses:
        assert status == launcher
    elif failed:
        assert status == max(failed)
    elif len(ranks) < 6 or 3 in ranks.values():
        assert status == max(launcher, 3)
    else:
        assert status == launcher
    if statuses:
        silent = [n for n in notes if "no exit status" in n]
        missing = sorted(set(range(6)) - set(ranks))
        assert silent == ([f"rank(s) {', '.join(map(str, missing))} left no exit status "
                           "(killed, or their host was lost)"] if missing else [])


def test_write_status_and_read_statuses_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(run.ENV, str(tmp_path))
    run.write_status(0, 3, 0, [])
    run.write_status(2, 3, LOST_RANKS_STATUS, [1])
    assert run.read_statuses(str(tmp_path)) == {0: record(0), 2: record(2, 3, lost=[1])}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank2.json"]
    run.write_status(2, 3, 0, [])                       # a later status replaces it
    assert run.read_statuses(str(tmp_path))[2] == record(2)
    assert run.job_status(0, run.read_statuses(str(tmp_path)))[0] == 3   # rank 1: none


def test_write_status_without_a_directory_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(run.ENV, raising=False)
    run.write_status(0, 1, 0, [])
    monkeypatch.setenv(run.ENV, str(tmp_path / "missing"))
    run.write_status(0, 1, 0, [])                       # complains, does not raise
    assert "could not write its status" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_read_statuses_skips_what_it_cannot_read(tmp_path, monkeypatch):
    monkeypatch.setenv(run.ENV, str(tmp_path))
    run.write_status(1, 2, 0, [])
    (tmp_path / "rank0.json").write_text("{not json")
    (tmp_path / "rank2.json").write_text(json.dumps({"size": 2, "status": 0}))   # no rank
    (tmp_path / "rank3.json").write_text(json.dumps([1, 2]))
    (tmp_path / "rank4.json").write_text(json.dumps({"rank": "four"}))
    (tmp_path / "rank5.json").write_bytes(b"\xff\xfe")
    (tmp_path / "rank6.json").mkdir()
    (tmp_path / "rank7.json.tmp").write_text(json.dumps(record(7)))
    (tmp_path / "notes.json").write_text(json.dumps(record(8)))
    assert run.read_statuses(str(tmp_path)) == {1: record(1, size=2)}


# -------------------------------------------------------------- sampler.rebind


@given(st.integers(0, 300), st.integers(1, 6), st.data())
def test_rebind_makes_the_sampler_that_rank_of_that_many_with_equal_shares(n, world, data):
    rank = data.draw(st.integers(0, world - 1))
    s = HeterogeneousSampler(range(n), 2, 1, shares=[Fraction(1, 4), Fraction(3, 4)], seed=3)
    s.rebind(rank, world)
    assert (s.rank, s.num_replicas) == (rank, world)
    equal = padded_counts(shares_to_counts([Fraction(1, world)] * world, n, world), n, True)
    assert s.counts() == equal and s.counts(epoch=9) == equal and len(s) == equal[rank]
    others = [HeterogeneousSampler(range(n), world, r, seed=3) for r in range(world)]
    assert s.indices() == others[rank].indices()
    union = sum((o.indices() for o in others[:rank] + [s] + others[rank + 1:]), [])
    assert set(union) == set(range(n)) and len(union) == sum(equal)


def test_rebind_keeps_a_running_pass_and_drops_shares_meant_for_the_old_world():
    s = HeterogeneousSampler(range(12), 2, 0, shuffle=False)
    it = iter(s)
    first = [next(it) for _ in range(3)]
    s.set_shares([Fraction(1, 3), Fraction(2, 3)])      # pending for the next epoch
    s.rebind(2, 3)
    assert first + list(it) == list(range(6))           # the old pass ends as it began
    s.set_epoch(1)
    assert s.counts() == (4, 4, 4) and list(s) == list(range(8, 12))


@pytest.mark.parametrize("rank,world", [(-1, 2), (2, 2), (0, 0), (0, -3), (1.0, 2), (0, 2.0),
                                        ("0", 2), (None, 2), (0, None)])
def test_rebind_refuses_what_is_not_a_rank(rank, world):
    s = HeterogeneousSampler(range(10), 2, 0)
    with pytest.raises(ValueError, match="is not a rank"):
        s.rebind(rank, world)
    assert (s.rank, s.num_replicas) == (0, 2)


@pytest.mark.parametrize("rank,world", [(True, 2), (0, True)])
def test_rebind_refuses_bools_as_the_constructor_does(rank, world):
    with pytest.raises(ValueError):
        HeterogeneousSampler(range(10), world, rank)
    s = HeterogeneousSampler(range(10), 2, 0)
    with pytest.raises(ValueError):
        s.rebind(rank, world)


# ------------------------------------------------- refusing a synchronous strategy


@pytest.mark.parametrize("strategy", SYNCHRONOUS)
def test_check_fault_tolerant_refuses_a_synchronous_strategy(strategy):
    with pytest.raises(OptionError, match=f"strategy {strategy} is synchronous"):
        check_fault_tolerant(strategy, 5.0)


@pytest.mark.parametrize("strategy", FAULT_TOLERANT)
def test_check_fault_tolerant_takes_an_asynchronous_strategy(strategy):
    check_fault_tolerant(strategy, 0.5)


@pytest.mark.parametrize("timeout", [0.0, -1.0, math.nan, math.inf])
def test_check_fault_tolerant_needs_a_timeout_above_zero(timeout):
    with pytest.raises(OptionError, match="--fault-timeout"):
        check_fault_tolerant("ashl", timeout)


def test_the_strategy_lists_agree():
    assert set(SYNCHRONOUS) | set(FAULT_TOLERANT) == set(STRATEGIES)
    assert not set(SYNCHRONOUS) & set(FAULT_TOLERANT)


@pytest.mark.parametrize("strategy", SYNCHRONOUS)
def test_strategy_options_refuse_fault_tolerant_for_a_synchronous_strategy(strategy):
    with pytest.raises(ValueError, match=f"strategy {strategy!r} is synchronous"):
        _strategy_options(strategy, 3, {"fault_tolerant": True})
    # off passes, and the strategy, which has no such option, never sees it
    assert "fault_tolerant" not in _strategy_options(strategy, 3, {"fault_tolerant": False})


@pytest.mark.parametrize("strategy", FAULT_TOLERANT)
def test_strategy_options_pass_fault_tolerant_on_for_an_asynchronous_strategy(strategy):
    assert _strategy_options(strategy, 3, {"fault_tolerant": True})["fault_tolerant"] is True


@pytest.mark.parametrize("strategy", ["localsgd", "diloco", "ashl-sync"])
def test_distributed_optimizer_refuses_fault_tolerant_before_it_starts(strategy):
    import ashl.torch as ashl
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # comm/hvd that cannot work: the refusal must come before anything touches them
    with pytest.raises(ValueError, match=f"strategy {strategy!r} is synchronous"):
        ashl.DistributedOptimizer(opt, model=model, strategy=strategy, fault_tolerant=True,
                                  comm=object(), hvd=object())


def test_the_run_is_settled_once_every_rank_left_or_was_declared_lost():
    assert not run.settled({})
    assert not run.settled({0: record(0, 3, lost=[1])})             # rank 2 still runs
    assert run.settled({0: record(0, 3, lost=[1]), 2: record(2, 3, lost=[1])})
    assert run.settled({r: record(r) for r in range(3)})


def test_an_earlier_jobs_statuses_are_cleared(tmp_path, monkeypatch):
    monkeypatch.setenv(run.ENV, str(tmp_path))
    run.write_status(1, 3, 0, [])
    (tmp_path / "notes.txt").write_text("kept")
    run.clear_statuses(str(tmp_path))
    assert run.read_statuses(str(tmp_path)) == {} and (tmp_path / "notes.txt").exists()


def test_the_wrapper_reads_statuses_without_starting_mpi():
    """python -m ashl.run runs outside the job; importing ashl.torch (where the ranks' exit
    code lives) starts MPI, so the wrapper's status rules must not need it."""
    import sys
    code = ("import json, sys, ashl.run as run; status, _ = run.job_status(0, {0: {'rank': 0, "
            "'size': 2, 'status': 0, 'lost': []}}); "
            "print(json.dumps([status, 'mpi4py.MPI' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [LOST_RANKS_STATUS, False]    # rank 1 left no status
    from ashl.torch import exit as exit_hook
    assert exit_hook.LOST_RANKS_STATUS is run.LOST_RANKS_STATUS == 3


def test_a_launcher_left_waiting_after_the_run_settled_is_ended(tmp_path, monkeypatch):
    """mpirun waiting for ever for a cut-off host's daemon: ashl.run ends it after --grace."""
    import sys
    monkeypatch.setenv(run.ENV, str(tmp_path))
    for r in (0, 1):
        run.write_status(r, 3, LOST_RANKS_STATUS, [2])
    waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    launcher, note = run._wait(waiting, str(tmp_path), grace_s=0.2)
    assert launcher == 0 and "it was ended" in note and waiting.poll() is not None
