"""ashl.coordinator's pure Coordinator: plans, drift, hysteresis, directives (no MPI; the
multi-rank runs are tests/mpi/test_coordinator_mpi.py)."""

from fractions import Fraction

import pytest

from ashl.coordinator import CommitReport, Coordinator, DriftConfig
from ashl.planner import Plan, PlannerConfig, RankProfile
from ashl.stages import Stage, StageConfig



class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def coordinator(n=3, compute=(0.01, 0.02, 0.04), link=0.001, stage=None, drift=None, planner=None):
    clock = Clock()
    # the fixed-k rule: these tests are about drift and directives, not the choice of k
    c = Coordinator(n, planner or PlannerConfig(comm_budget=None), stage or StageConfig(),
                    drift or DriftConfig(), clock)
    c.plan_from_profiles([RankProfile(compute_s=x, push_s=link, pull_s=link) for x in compute])
    return c, clock


def commit(c, clock, rank, step_s=None, loss=1.0, version=None, link_s=None, epoch=0):
    clock.t += 0.01
    v = c.plan.version if version is None else version
    return c.on_commit(CommitReport(rank=rank, plan_version=v, step_s=step_s, link_s=link_s,
                                    loss=loss, epoch=epoch))


# ----------------------------------------------------------------------- pure


def test_first_plan_moves_to_ahl_and_is_logged():
    c, _ = coordinator()
    assert c.stage is Stage.AHL and c.plan.version == 1
    assert [e.kind for e in c.events] == ["plan", "stage"]
    assert c.plan.ahl.local_steps == (32, 16, 8)


def test_commit_before_plan_and_bad_rank():
    c = Coordinator(2, clock=Clock())
    with pytest.raises(RuntimeError, match="before the first plan"):
        c.on_commit(CommitReport(rank=0, plan_version=0))
    c, clock = coordinator()
    with pytest.raises(ValueError, match="rank 7"):
        commit(c, clock, 7)


def test_directive_carries_plan_only_when_stale():
    c, clock = coordinator()
    d = commit(c, clock, 0, version=1)
    assert d.plan is None and d.plan_version == 1 and d.stage is Stage.AHL and not d.stop
    d = commit(c, clock, 0, version=0)
    assert d.plan == c.plan
    assert Plan.from_json(d.plan.to_json()) == d.plan   # what the server's PLAN message carries


def test_sustained_drift_replans_within_a_few_commits():
    c, clock = coordinator()
    for _ in range(3):                              # everyone as planned
        for r, s in enumerate((0.01, 0.02, 0.04)):
            commit(c, clock, r, step_s=s, epoch=2)
    assert c.plan.version == 1
    seen = 0
    for i in range(5):                              # rank 2 becomes 4x faster
        d = commit(c, clock, 2, step_s=0.01, version=1)
        if d.plan is not None:
            seen = i + 1
            break
    assert seen == 3                                # median of 5 flips on the 3rd fast report
    assert c.plan.version == 2
    assert c.plan.profiles[2].compute_s == pytest.approx(0.01)
    assert c.plan.ahl.local_steps == (16, 8, 16)
    assert "drift: rank 2 compute -75%" in c.events[-1].reason


def test_noise_under_threshold_and_single_spikes_do_not_replan():
    c, clock = coordinator()
    noise = [1.15, 0.87, 1.1, 3.0, 0.9, 1.18, 0.85, 1.0, 4.0, 1.12]   # +-18 %, and rare spikes
    for f in noise:
        for r, s in enumerate((0.01, 0.02, 0.04)):
            commit(c, clock, r, step_s=s * f)
    assert c.plan.version == 1


def test_hysteresis_refreshes_only_ranks_beyond_release():
    c, clock = coordinator()
    factors = (1.05, 1.15, 1.5)                   # 5 % keeps, 15 % refreshes, 50 % triggers
    for _ in range(3):
        for r, s in enumerate((0.01, 0.02, 0.04)):
            commit(c, clock, r, step_s=s * factors[r])
    assert c.plan.version == 2
    assert c.plan.profiles[0].compute_s == 0.01
    assert c.plan.profiles[1].compute_s == pytest.approx(0.023)
    assert c.plan.profiles[2].compute_s == pytest.approx(0.06)


def test_cooldown_between_replans():
    c, clock = coordinator(drift=DriftConfig(cooldown_commits=10, window=3, min_reports=3,
                                             cooldown_s=0.0))
    for _ in range(3):
        commit(c, clock, 0, step_s=0.02)
    assert c.plan.version == 2
    for _ in range(3):
        commit(c, clock, 0, step_s=0.04)         # another doubling, inside the cooldown
    assert c.plan.version == 2
    for _ in range(7):
        commit(c, clock, 0, step_s=0.04)
    assert c.plan.version == 3


def test_cooldown_in_seconds_between_replans():
    c, clock = coordinator(drift=DriftConfig(cooldown_commits=0, window=3, min_reports=3,
                                             cooldown_s=1e6))
    for _ in range(3):
        commit(c, clock, 0, step_s=0.02)
    assert c.plan.version == 2
    for _ in range(20):
        commit(c, clock, 0, step_s=0.08)         # drifted again, but too soon
    assert c.plan.version == 2


def test_small_absolute_change_is_ignored():
    # rank 0's link doubles, but its link is 0.1 % of the round: no re-plan for that
    c, clock = coordinator(link=1e-5)
    for _ in range(5):
        commit(c, clock, 0, link_s=4e-5)
    assert c.plan.version == 1


def test_link_drift_replans_with_scaled_link():
    c, clock = coordinator(compute=(0.01, 0.01, 0.01), link=0.05)
    for _ in range(3):
        commit(c, clock, 1, link_s=0.3)          # planned 0.1 s round trip, measured 0.3
    assert c.plan.version == 2
    assert c.plan.profiles[1].push_s == pytest.approx(0.15)
    assert c.plan.ahl.local_steps[1] == 8 and c.plan.ahl.bottleneck == 1


def test_drift_can_be_disabled():
    c, clock = coordinator(drift=DriftConfig(enabled=False))
    for _ in range(6):
        commit(c, clock, 0, step_s=0.05)
    assert c.plan.version == 1


def test_stage_switch_and_stop_reach_every_rank_with_reasons():
    c, clock = coordinator(stage=StageConfig(switch_loss=0.3, max_commits=8, ahl_max_commits=100))
    assert c.plan.ahl.shares == (Fraction(4, 7), Fraction(2, 7), Fraction(1, 7))
    for r in range(3):
        assert commit(c, clock, r, loss=1.0).stage is Stage.AHL
    assert commit(c, clock, 0, loss=0.1).stage is Stage.AHL      # 4/7*0.1 + 3/7*1.0 = 0.486
    assert c.global_loss == pytest.approx(4 / 7 * 0.1 + 3 / 7)
    d = commit(c, clock, 1, loss=0.1)                             # 6/7*0.1 + 1/7*1.0 = 0.229
    assert d.stage is Stage.SHL and not d.stop
    assert c.machine._weights == c.plan.shl.shares                # global loss now uses SHL shares
    assert commit(c, clock, 2, loss=0.1).stage is Stage.SHL      # learns at its next commit
    assert commit(c, clock, 0, loss=0.1).stage is Stage.SHL
    d = commit(c, clock, 1, loss=0.1)                             # 8th commit
    assert d.stop and d.stage is Stage.DONE and "commit budget" in d.reason
    d = commit(c, clock, 2, loss=0.1)
    assert d.stop
    kinds = [(e.kind, e.reason.split(":")[0]) for e in c.events]
    assert kinds[-2:] == [("stage", "AHL -> SHL"), ("stop", "SHL -> DONE")]


def test_evaluation_accuracy_stops_run():
    c, clock = coordinator(stage=StageConfig(target_accuracy=0.8))
    c.on_evaluation(accuracy=0.85)
    assert c.stage is Stage.DONE and commit(c, clock, 0).stop


def test_new_shares_apply_from_an_epoch_no_rank_has_begun():
    """The ranks hear of a re-plan or a stage switch at different moments, in different
    epochs: the directive names one epoch, past the furthest any rank may have begun (its
    last report plus twice the most epochs a rank began between two reports: it hears with
    the reply to its next commit), so every epoch is read with one set of shares by every
    rank."""
    c, clock = coordinator(stage=StageConfig(switch_loss=0.3, ahl_max_commits=100))
    c.note_epochs([0, 1, 0])                 # the first plan's collective: nobody moving
    assert c.shares_epoch == 2
    for r, e in ((0, 1), (1, 2), (2, 1)):
        assert commit(c, clock, r, step_s=(0.01, 0.02, 0.04)[r], epoch=e).shares_epoch == 2
    commit(c, clock, 1, step_s=0.02, epoch=4)     # rank 1 began two epochs in one round
    for _ in range(3):                            # rank 2 becomes 4x faster: a re-plan
        d = commit(c, clock, 2, step_s=0.01, epoch=1, version=1)
    assert c.plan.version == 2 and d.plan is not None
    assert d.shares_epoch == c.shares_epoch == 4 + 2 * 2 + 1
    # a stage switch restamps too; the answers carry the newest epoch until the next change
    assert commit(c, clock, 1, loss=1.0, epoch=6).shares_epoch == 9      # no change: as is
    commit(c, clock, 2, loss=0.1, epoch=1)
    d = commit(c, clock, 0, loss=0.1, epoch=3)
    assert d.stage is Stage.SHL and d.shares_epoch == 6 + 2 * 2 + 1
    assert commit(c, clock, 2, loss=0.1, epoch=2).shares_epoch == 11


def test_a_late_epoch_report_never_moves_a_rank_back():
    c, clock = coordinator()
    c.note_epochs([3, 3, 3])
    commit(c, clock, 0, epoch=5)
    commit(c, clock, 0, epoch=4)             # out of order: the furthest stands
    assert c._epochs[0] == 5 and c._epoch_lead == 2


@pytest.mark.parametrize("probes", [(1024, 1024, 1024), (1024, 512, 4096)])
def test_a_link_larger_than_the_probe_is_timed_as_the_probe_and_extrapolated(monkeypatch, probes):
    """Three in-process ranks on a virtual clock: every message arrives 20 ms plus 1 us a
    byte after it is sent. Only the root's probe and one-byte messages travel, also when
    the other ranks ask for other probe sizes, and each rank's push and pull come back as
    the payload's own would take (its latency counted once, not scaled with the transfer)."""
    import dataclasses
    import threading
    import time as real_time
    import types
    from collections import defaultdict, deque

    from fake_world import FakeComm, FakeWorld

    from ashl import coordinator
    from ashl.coordinator import MPICoordinator
    from ashl.profiler import RoundTrips

    latency_s, byte_s = 0.020, 1e-6
    clock, arrivals, sizes = threading.local(), defaultdict(deque), []
    now = lambda: getattr(clock, "t", 0.0)      # noqa: E731 (each rank's thread its own)
    real_send, real_recv = FakeComm.Send, FakeComm.Recv

    def send(self, buf, dest, tag=0):
        n = memoryview(buf).nbytes
        if tag in (coordinator._LINK_PUSH, coordinator._LINK_PULL):
            sizes.append(n)
        arrivals[(id(self.group), self.rank, dest, tag)].append(now() + latency_s + n * byte_s)
        real_send(self, buf, dest, tag)

    def recv(self, buf, source, tag=0):
        real_recv(self, buf, source, tag)
        clock.t = max(now(), arrivals[(id(self.group), source, self.rank, tag)].popleft())

    monkeypatch.setattr(FakeComm, "Send", send)
    monkeypatch.setattr(FakeComm, "Recv", recv)
    monkeypatch.setattr(coordinator, "time", types.SimpleNamespace(
        perf_counter=now, sleep=real_time.sleep, monotonic=real_time.monotonic))
    # warmup=1: a rank's clock starts at 0 (the go-ahead is not timed), and its first,
    # untimed, exchange absorbs the time the root spent serving the ranks before it
    payload, trips = 1 << 14, RoundTrips(repeats=3, warmup=1, budget_s=0.0, probe_bytes=1024)

    def run(comm, hvd):
        mc = MPICoordinator(comm)
        mine = dataclasses.replace(trips, probe_bytes=probes[comm.Get_rank()])
        push, pull = mc.measure_link(payload, mine)
        mc.close()
        return push, pull

    _, *ranks = FakeWorld(3).run(run)
    for push, pull in ranks:
        assert push.count == pull.count == 2
        # a push: the payload there, one byte back; a pull: one byte there, the payload back
        for t in (push.mean, push.minimum, pull.mean, pull.maximum):
            assert t == pytest.approx(2 * latency_s + (payload + 1) * byte_s, rel=1e-3)
    assert set(sizes) == {1, 1024}
