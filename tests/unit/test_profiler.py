"""ashl.profiler: robust summaries, timers, round trips; ashl.emulation's slowdown."""

import time

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ashl.emulation import (ComputeSlowdown, Heterogeneity, compute_factor_from_env,
                            factors_from_string, step_time_from_env)
from ashl.profiler import RankProfiler, RoundTrips, StepTimer, measure_round_trip, summarize


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_five_samples_warmup_dropped_no_trim():
    s = summarize([10.0, 1.0, 2.0, 3.0, 4.0])
    assert (s.count, s.warmup, s.trimmed, s.used) == (5, 1, 0, 4)
    assert s.mean == pytest.approx(2.5)
    assert s.median == pytest.approx(2.5)


def test_five_thousand_samples_trim_ten_percent_each_side():
    values = [100.0] * 10 + [1.0] * 4980 + [1e6] * 10     # warm-up spikes and outliers
    s = summarize(values)
    assert s.warmup == 500 and s.trimmed == 450
    assert s.mean == pytest.approx(1.0)
    assert s.maximum == 1e6


def test_single_sample_is_kept():
    s = summarize([0.25])
    assert (s.warmup, s.used, s.mean) == (0, 1, 0.25)


def test_bad_samples():
    with pytest.raises(ValueError, match="no timing samples"):
        summarize([])
    with pytest.raises(ValueError, match="compute: sample 1"):
        summarize([0.1, float("nan")], name="compute")
    with pytest.raises(ValueError, match="trim"):
        summarize([0.1], trim=0.5)


@given(st.lists(st.floats(min_value=0, max_value=1e3), min_size=1, max_size=300))
def test_summary_is_within_range(values):
    s = summarize(values)
    assert s.used >= 1
    kept = values[s.warmup:]
    assert min(kept) - 1e-9 <= s.mean <= max(kept) + 1e-9
    assert s.used == len(kept) - 2 * s.trimmed


def test_step_timer_records_blocks_and_skips_failures():
    clock = FakeClock()
    timer = StepTimer(clock)
    with timer:
        clock.sleep(0.5)
    timer.time(clock.sleep, 0.25)
    with pytest.raises(RuntimeError):
        with timer:
            raise RuntimeError("step failed")
    assert timer.samples == [0.5, 0.25]


def test_round_trip_runs_warmup_then_repeats():
    calls = []
    summary = measure_round_trip(lambda: calls.append(1),
                                 RoundTrips(repeats=7, warmup=3, budget_s=float("inf")))
    assert len(calls) == 10 and summary.count == 7 and summary.warmup == 0


def test_a_slow_round_trip_is_timed_only_until_the_budget_is_spent():
    """Each exchange takes 0.4 s on this clock: the warm-up and two timed ones (the least)
    spend the 1 s budget, and no more are taken."""
    now, calls = [0.0], []

    def exchange():
        calls.append(1)
        now[0] += 0.4

    summary = measure_round_trip(exchange, RoundTrips(repeats=10, warmup=1, min_repeats=2,
                                                      budget_s=1.0), clock=lambda: now[0])
    assert len(calls) == 3 and summary.count == 2 and summary.mean == pytest.approx(0.4)


@given(repeats=st.integers(1, 12), warmup=st.integers(0, 3), min_repeats=st.integers(1, 12),
       budget_s=st.floats(0, 5), step_s=st.floats(0.001, 2))
def test_round_trips_take_between_the_least_and_the_most(repeats, warmup, min_repeats,
                                                         budget_s, step_s):
    assume(min_repeats <= repeats)
    trips = RoundTrips(repeats=repeats, warmup=warmup, min_repeats=min_repeats,
                       budget_s=budget_s)
    now = [0.0]
    summary = measure_round_trip(lambda: now.__setitem__(0, now[0] + step_s), trips,
                                 clock=lambda: now[0])
    # the least that spends the budget, at least min_repeats, at most repeats
    spends = next((k for k in range(repeats + 1)
                   if now_after(warmup + k, step_s) >= budget_s), repeats)
    assert summary.count == min(repeats, max(min_repeats, spends))


def now_after(exchanges, step_s):
    """The clock after `exchanges` steps of `step_s`, summed as the test's clock sums them."""
    now = 0.0
    for _ in range(exchanges):
        now += step_s
    return now


@pytest.mark.parametrize("bad", [dict(repeats=0), dict(min_repeats=0), dict(min_repeats=11),
                                 dict(warmup=-1), dict(budget_s=-1.0), dict(repeats=2.5),
                                 dict(budget_s="1"), dict(budget_s=True),
                                 dict(budget_s=float("nan")), dict(probe_bytes=0),
                                 dict(probe_bytes=1.5), dict(probe_bytes=True),
                                 dict(latency_repeats=-1), dict(latency_repeats=0.5)])
def test_round_trips_refuse_a_count_or_budget_that_cannot_be(bad):
    with pytest.raises(ValueError, match="round trips"):
        RoundTrips(**bad)


@given(payload=st.integers(-3, 1 << 24), probe=st.integers(1, 1 << 22))
def test_a_probe_is_the_payload_up_to_the_cap_and_never_empty(payload, probe):
    size = RoundTrips(probe_bytes=probe).probe_size(payload)
    assert size == max(1, min(payload, probe))


def test_an_extrapolated_summary_scales_what_is_over_the_latency_and_keeps_the_counts():
    s = summarize([0.3, 0.1, 0.2, 0.4], min_warmup=0)
    x = s.extrapolated(0.05, 4.0)
    assert (x.count, x.warmup, x.trimmed, x.used) == (s.count, s.warmup, s.trimmed, s.used)
    assert (x.mean, x.median, x.minimum, x.maximum) == pytest.approx(
        [0.05 + 4 * (t - 0.05) for t in (s.mean, s.median, s.minimum, s.maximum)])
    assert s.extrapolated(0.0, 1.0) == s
    assert s.extrapolated(0.15, 4.0).minimum == pytest.approx(0.1)   # under the latency: as is
    for latency, scale in ((0.0, 0.0), (0.0, -1.0), (0.0, float("inf")), (0.0, float("nan")),
                           (-0.1, 2.0), (float("nan"), 2.0)):
        with pytest.raises(ValueError, match="scale|latency"):
            s.extrapolated(latency, scale)


def test_only_a_payload_larger_than_the_probe_times_its_latency():
    trips = RoundTrips(probe_bytes=1000, latency_repeats=3)
    assert [trips.latency_trips(n) for n in (0, 1, 999, 1000, 1001)] == [0, 0, 0, 0, 3]


def test_a_payload_timed_as_another_ranks_probe_times_its_latency():
    """A rank times the root's probe size; a payload that differs from it, larger or
    smaller, is extrapolated, so its latency is timed."""
    trips = RoundTrips(probe_bytes=1000, latency_repeats=3)
    assert [trips.latency_trips(n, probe_bytes=500) for n in (400, 500, 600)] == [3, 0, 3]


def test_round_trips_are_given_as_round_trips():
    with pytest.raises(TypeError, match="RoundTrips"):
        measure_round_trip(lambda: None, 20)


def test_rank_profiler_builds_profile():
    rp = RankProfiler(name="gpu0")
    rp.extend("compute", [1.0] + [0.1] * 20)
    rp.extend("push", [0.02] * 5)
    rp.extend("pull", [0.03] * 5)
    p = rp.profile()
    assert p.compute_s == pytest.approx(0.1) and p.push_s == pytest.approx(0.02)
    assert p.compress_s == 0.0 and p.name == "gpu0"
    with pytest.raises(ValueError, match="no pull samples"):
        r = RankProfiler()
        r.record("compute", 0.1)
        r.record("push", 0.1)
        r.profile()
    with pytest.raises(ValueError, match="unknown field"):
        rp.record("latency", 0.1)


def test_compute_slowdown_multiplies_step_time():
    clock = FakeClock()
    slow = ComputeSlowdown(4.0, clock=clock, sleep=clock.sleep)
    with slow:
        clock.sleep(0.01)
    assert clock.t == pytest.approx(0.04)
    slow.factor = 1.0
    slow.run(clock.sleep, 0.01)
    assert clock.t == pytest.approx(0.05)
    with pytest.raises(ValueError):
        slow.factor = 0.5


@given(factor=st.floats(1, 8), step_s=st.one_of(st.none(), st.floats(1e-3, 1.0)),
       elapsed=st.floats(0, 2.0))
def test_emulated_step_is_what_a_stretched_step_lasts(factor, step_s, elapsed):
    clock = FakeClock()
    slow = ComputeSlowdown(factor, clock=clock, sleep=clock.sleep, step_s=step_s)
    predicted = slow.emulated(elapsed)
    with slow:
        clock.sleep(elapsed)
    assert clock.t == pytest.approx(predicted)


def test_compute_slowdown_pays_back_oversleep():
    clock = FakeClock()
    late = lambda s: clock.sleep(s + 0.004)       # every wake-up 4 ms late
    slow = ComputeSlowdown(3.0, clock=clock, sleep=late)
    starts = []
    for _ in range(10):
        starts.append(clock.t)
        with slow:
            clock.sleep(0.01)
    # without pay-back each step would take 34 ms; on average it is 30 ms
    assert (clock.t - starts[0]) / 10 == pytest.approx(0.03, abs=0.0005)


def test_compute_slowdown_real_sleep():
    slow = ComputeSlowdown(3.0)
    t0 = time.perf_counter()
    with slow:
        time.sleep(0.01)
    assert time.perf_counter() - t0 == pytest.approx(0.03, rel=0.5)


def test_factor_parsing(monkeypatch):
    assert factors_from_string("1, 2,4") == [1.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="bad slowdown"):
        factors_from_string("1,x")
    monkeypatch.setenv("ASHL_EMULATE_COMPUTE", "1,2")
    assert compute_factor_from_env(1) == 2.0 and compute_factor_from_env(5) == 1.0


@given(st.floats(1.0, 8.0), st.floats(0.001, 0.1),
       st.lists(st.floats(0.0, 0.5), min_size=1, max_size=20))
def test_a_step_time_makes_every_step_last_factor_times_it_or_counts_an_overrun(
        factor, step_s, computes):
    clock = FakeClock()
    slow = ComputeSlowdown(factor, clock=clock, sleep=clock.sleep, step_s=step_s)
    budget = factor * step_s
    assume(all(abs(c - budget) > 1e-5 for c in computes))
    for c in computes:
        start = clock.t
        with slow:
            clock.sleep(c)                      # the real forward/backward
        assert clock.t - start == pytest.approx(max(c, budget))
    assert slow.steps == len(computes)
    assert slow.overruns == sum(c > budget for c in computes)


def test_step_time_from_the_environment(monkeypatch):
    monkeypatch.delenv("ASHL_EMULATE_STEP_TIME", raising=False)
    assert step_time_from_env() is None
    assert Heterogeneity.from_env(0).slowdown() is None           # real speed: no stretcher
    monkeypatch.setenv("ASHL_EMULATE_STEP_TIME", "0.02")
    monkeypatch.setenv("ASHL_EMULATE_COMPUTE", "1,4")
    slow = Heterogeneity.from_env(1).slowdown()
    assert (slow.factor, slow.step_s, slow.active) == (4.0, 0.02, True)
    assert Heterogeneity.from_env(0).slowdown().step_s == 0.02    # factor 1 still emulated
    monkeypatch.setenv("ASHL_EMULATE_STEP_TIME", "0")
    assert step_time_from_env() is None                            # 0: real speed
    for bad in ("-1", "nan", "fast"):
        monkeypatch.setenv("ASHL_EMULATE_STEP_TIME", bad)
        with pytest.raises(ValueError, match="ASHL_EMULATE_STEP_TIME"):
            step_time_from_env()
