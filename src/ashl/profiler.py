"""Timing samples -> robust summaries -> a RankProfile for the planner.

Profiling steps are the run's real training steps: the engine wraps the steps it takes
anyway in a StepTimer, so profiling costs no lost training (the authors ran it at
learning rate 0). Push and pull are timed as round trips carrying the real payload (or a
probe of it, extrapolated: RoundTrips) on one clock; no two machines' clocks are ever
compared.

Summary rule (works with 5 samples or 5,000):
  1. warm-up: drop the first max(min_warmup, floor(warmup_fraction * n)) samples, but
     always keep at least one;
  2. trim: of the m samples left, drop floor(trim * m) from each end (nothing when
     m < 1/trim, so small samples are not emptied);
  3. mean of what remains ("trimmed mean", the value the planner uses) and the median.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from .planner import RankProfile

__all__ = ["TimingSummary", "summarize", "StepTimer", "RoundTrips", "measure_round_trip",
           "RankProfiler"]

DEFAULT_WARMUP_FRACTION = 0.1
DEFAULT_MIN_WARMUP = 1
DEFAULT_TRIM = 0.1


@dataclass(frozen=True)
class TimingSummary:
    count: int          # samples given
    warmup: int         # dropped from the start
    trimmed: int        # dropped from each end after warm-up
    used: int           # samples averaged
    mean: float         # trimmed mean
    median: float       # median after warm-up
    minimum: float
    maximum: float

    def to_dict(self) -> dict:
        return self.__dict__.copy()

    def extrapolated(self, latency_s: float, scale: float) -> "TimingSummary":
        """A probe's times as a payload's `scale` times its size: the latency as it is, the
        rest (the transfer) scaled, latency + (t - latency) x scale; a time under the
        latency stays as it is."""
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        if not (math.isfinite(latency_s) and latency_s >= 0):
            raise ValueError(f"latency must be a finite number >= 0, got {latency_s!r}")

        def payload_s(t: float) -> float:
            fixed = min(latency_s, t)
            return fixed + (t - fixed) * scale

        return dataclasses.replace(self, mean=payload_s(self.mean), median=payload_s(self.median),
                                   minimum=payload_s(self.minimum), maximum=payload_s(self.maximum))


def summarize(samples: Iterable[float], *, warmup_fraction: float = DEFAULT_WARMUP_FRACTION,
              min_warmup: int = DEFAULT_MIN_WARMUP, trim: float = DEFAULT_TRIM,
              name: str = "samples") -> TimingSummary:
    """Robust summary of timing samples (seconds); see the module doc for the rule."""
    values = [float(s) for s in samples]
    if not values:
        raise ValueError(f"{name}: no timing samples")
    for i, v in enumerate(values):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}: sample {i} must be a finite number >= 0, got {v!r}")
    if not 0 <= warmup_fraction < 1:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction!r}")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")
    if min_warmup < 0:
        raise ValueError(f"min_warmup must be >= 0, got {min_warmup!r}")
    n = len(values)
    warm = min(n - 1, max(min_warmup, math.floor(warmup_fraction * n)))
    kept = values[warm:]
    cut = math.floor(trim * len(kept))
    core = sorted(kept)[cut:len(kept) - cut]
    return TimingSummary(count=n, warmup=warm, trimmed=cut, used=len(core),
                         mean=math.fsum(core) / len(core), median=statistics.median(kept),
                         minimum=min(kept), maximum=max(kept))


class StepTimer:
    """Collects wall-clock durations: `with timer: step()` or `timer.time(fn, ...)`."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.samples: list[float] = []
        self._start: float | None = None

    def __enter__(self) -> "StepTimer":
        self._start = self.clock()
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:                     # a failed step is not a timing sample
            self.samples.append(self.clock() - self._start)
        self._start = None

    def time(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self:
            return fn(*args, **kwargs)

    def add(self, seconds: float) -> None:
        self.samples.append(float(seconds))

    def summary(self, **kwargs: Any) -> TimingSummary:
        return summarize(self.samples, **kwargs)

    def clear(self) -> None:
        self.samples.clear()


@dataclass(frozen=True)
class RoundTrips:
    """How many round trips a link measurement takes: `warmup` untimed (over MPI, one byte
    each way: the connection's set-up), then up to `repeats` timed, but no more once
    `min_repeats` are timed and `budget_s` has passed since the first. Links are timed one
    rank at a time while every rank waits, and a slow link's round trip can take over a
    second (a 4 MB model through 56 Mbit/s): with a fixed 12 per rank, a 4-rank job on
    shaped links made its first plan after 30 s instead of 10 s.

    A timed message carries at most `probe_bytes` (`probe_size`), so every rank's turn costs
    about the same whatever the model's size (a 100 MB model takes 0.8 s each way at
    1 Gbit/s). A larger payload's time is extrapolated from the probe's: the link's latency,
    the least of `latency_repeats` one-byte round trips timed after the warm-ups, plus the
    probe's transfer scaled by payload / probe (`TimingSummary.extrapolated`). With
    `latency_repeats=0` the latency is taken as 0 and the probe's whole time is scaled.
    Over MPI the root's probe size is the one every rank times (`measure_link`), so a rank's
    own `probe_bytes` counts only on the root, and a payload smaller than the root's probe
    is extrapolated (down) as well."""

    repeats: int = 10
    warmup: int = 1
    min_repeats: int = 2
    budget_s: float = 1.0
    probe_bytes: int = 1 << 20
    latency_repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("repeats", "warmup", "min_repeats", "probe_bytes", "latency_repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"round trips: {name} must be an integer >= 0, got {value!r}")
        if not 1 <= self.min_repeats <= self.repeats:
            raise ValueError(f"round trips: need 1 <= min_repeats <= repeats, got "
                             f"min_repeats={self.min_repeats!r}, repeats={self.repeats!r}")
        if (not isinstance(self.budget_s, (int, float)) or isinstance(self.budget_s, bool)
                or not self.budget_s >= 0):
            raise ValueError(f"round trips: budget_s must be >= 0, got {self.budget_s!r}")
        if self.probe_bytes < 1:
            raise ValueError(f"round trips: probe_bytes must be >= 1, got {self.probe_bytes!r}")

    def probe_size(self, payload_bytes: int) -> int:
        """Bytes a timed message carries for a `payload_bytes` payload (at least one)."""
        return max(1, min(int(payload_bytes), self.probe_bytes))

    def latency_trips(self, payload_bytes: int, probe_bytes: int | None = None) -> int:
        """One-byte round trips timed as the latency: only a payload timed as a probe of
        another size (`probe_bytes`, by default `probe_size`'s) needs it."""
        probe = self.probe_size(payload_bytes) if probe_bytes is None else int(probe_bytes)
        return self.latency_repeats if probe != max(1, int(payload_bytes)) else 0

    def enough(self, exchanges: int, elapsed_s: float) -> bool:
        """Stop after `exchanges` exchanges (warm-ups included, latency trips not) that took
        `elapsed_s`?"""
        timed = exchanges - self.warmup
        return timed >= self.repeats or (timed >= self.min_repeats and elapsed_s >= self.budget_s)


def measure_round_trip(exchange: Callable[[], Any], trips: RoundTrips = RoundTrips(), *,
                       clock: Callable[[], float] = time.perf_counter,
                       **summary_kwargs: Any) -> TimingSummary:
    """Time `exchange` (a real send + wait for the answer, with the real payload).

    For a push, exchange() sends the payload and waits for a small acknowledgement;
    for a pull, it sends a small request and receives the payload. The warm-up calls run
    first and are not recorded (connection set-up, buffer registration).
    """
    if not isinstance(trips, RoundTrips):
        raise TypeError(f"trips must be a RoundTrips, got {trips!r}")
    timer, start, exchanges = StepTimer(clock), clock(), 0
    while not trips.enough(exchanges, clock() - start):
        if exchanges < trips.warmup:
            exchange()
        else:
            timer.time(exchange)
        exchanges += 1
    summary_kwargs.setdefault("min_warmup", 0)   # the warm-up calls already ran
    return timer.summary(**summary_kwargs)


class RankProfiler:
    """One rank's profiling samples; `.profile()` gives the planner's input."""

    FIELDS = ("compute", "push", "pull", "compress")

    def __init__(self, name: str = ""):
        self.name = name
        self.samples: dict[str, list[float]] = {f: [] for f in self.FIELDS}

    def record(self, field: str, seconds: float) -> None:
        if field not in self.samples:
            raise ValueError(f"unknown field {field!r}; expected one of {self.FIELDS}")
        self.samples[field].append(float(seconds))

    def extend(self, field: str, seconds: Sequence[float]) -> None:
        for s in seconds:
            self.record(field, s)

    def summaries(self, **kwargs: Any) -> dict[str, TimingSummary]:
        return {f: summarize(v, name=f, **kwargs) for f, v in self.samples.items() if v}

    def profile(self, **kwargs: Any) -> RankProfile:
        s = self.summaries(**kwargs)
        for required in ("compute", "push", "pull"):
            if required not in s:
                raise ValueError(f"profile{' of ' + self.name if self.name else ''}: "
                                 f"no {required} samples recorded")
        return RankProfile(compute_s=s["compute"].mean, push_s=s["push"].mean,
                           pull_s=s["pull"].mean,
                           compress_s=s["compress"].mean if "compress" in s else 0.0,
                           name=self.name)
