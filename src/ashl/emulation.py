"""Emulated heterogeneity for tests and benchmarks.

Heterogeneity(compute_factor, link) is one rank's emulated hardware, handed to a strategy
(DistributedOptimizer(..., heterogeneity=...)) or read from ASHL_EMULATE_* variables. Link
delays sit on the message itself: a sender's message departs late, a receiver holds a
reply until its arrival time (send time + delay on the host-wide monotonic clock).

ComputeSlowdown makes a step take `factor` times its real duration: after the real
work it sleeps (factor - 1) * elapsed. With a step time S (ASHL_EMULATE_STEP_TIME) a step
lasts factor x S instead, the real forward/backward inside it: a GPU's step, with its host
CPU idle, so many ranks can share a few cores; a step whose real compute exceeds the budget
is counted as an overrun (an overloaded machine must not pass for an emulated cluster).
The factor may be changed mid-run (drift tests).
A sleep that overshoots (a loaded machine wakes sleepers late) is paid back from the
next step's sleep, so the average step is factor x its real time even under load.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

__all__ = ["BACKWARD_SHARE", "ComputeSlowdown", "factors_from_string", "compute_factor_from_env",
           "step_time_from_env", "Link",
           "DEFAULT_LINK", "Heterogeneity", "sleep_until"]

ENV_COMPUTE = "ASHL_EMULATE_COMPUTE"
# The backward pass's share of a step (it costs about twice the forward): Horovod's
# gradient allreduces start as backward produces each gradient, so run beside it.
BACKWARD_SHARE = 2.0 / 3.0
ENV_STEP_TIME = "ASHL_EMULATE_STEP_TIME"   # seconds: a factor-1 rank's step, GPU-like


def _check_factor(factor: float) -> float:
    if (not isinstance(factor, (int, float)) or isinstance(factor, bool)
            or not math.isfinite(factor) or factor < 1):
        raise ValueError(f"slowdown factor must be a finite number >= 1, got {factor!r}")
    return float(factor)


def _check_step_time(step_s: Optional[float]) -> Optional[float]:
    if step_s is None:
        return None
    if (not isinstance(step_s, (int, float)) or isinstance(step_s, bool)
            or not math.isfinite(step_s) or step_s <= 0):
        raise ValueError(f"emulated step time must be a finite number of seconds > 0, "
                         f"got {step_s!r}")
    return float(step_s)


def step_time_from_env() -> Optional[float]:
    """ASHL_EMULATE_STEP_TIME in seconds, or None when unset or 0 (steps at their real speed)."""
    text = os.environ.get(ENV_STEP_TIME, "").strip()
    if not text:
        return None
    try:
        value = float(text)
        return None if value == 0 else _check_step_time(value)
    except ValueError as exc:
        raise ValueError(f"{ENV_STEP_TIME}={text!r}: {exc}") from None


class ComputeSlowdown:
    """`with slowdown: real_step()` -> the block takes `factor` times as long."""

    def __init__(self, factor: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, step_s: Optional[float] = None):
        self._factor = _check_factor(factor)
        self.step_s = _check_step_time(step_s)
        self.clock, self.sleep = clock, sleep
        self._start: float | None = None
        self._carry = 0.0          # <= 0: oversleep still to be paid back
        self.steps = 0
        self.overruns = 0          # steps whose real compute exceeded factor x step_s

    @property
    def factor(self) -> float:
        return self._factor

    @property
    def active(self) -> bool:
        return self._factor != 1.0 or self.step_s is not None

    def emulated(self, elapsed: float) -> float:
        """The wall time a step of `elapsed` real seconds lasts once stretched (counts
        nothing)."""
        if self.step_s is None:
            return self._factor * elapsed
        return max(elapsed, self._factor * self.step_s)

    def extra(self, elapsed: float) -> float:
        """The seconds to sleep after a step of `elapsed` real seconds."""
        self.steps += 1
        if self.step_s is None:
            return (self._factor - 1) * elapsed
        budget = self._factor * self.step_s
        if elapsed > budget + 1e-6:          # beyond the clock's rounding
            self.overruns += 1
        return max(0.0, budget - elapsed)

    @factor.setter
    def factor(self, value: float) -> None:
        self._factor = _check_factor(value)

    def __enter__(self) -> "ComputeSlowdown":
        self._start = self.clock()
        return self

    def __exit__(self, *exc: Any) -> None:
        start, self._start = self._start, None
        self.stretch(start)

    def stretch(self, since: float) -> None:
        """Sleep so that the span from `since` (a reading of `clock`) to now takes `factor`
        times as long."""
        extra = self.extra(self.clock() - since)
        if extra <= 0:
            return
        owed = extra + self._carry
        if owed > 0:
            t0 = self.clock()
            self.sleep(owed)
            owed -= self.clock() - t0
        # Pay back at most one step's extra time, so one long stall cannot erase the
        # slowdown of many later steps.
        self._carry = max(min(owed, 0.0), -extra)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self:
            return fn(*args, **kwargs)


def factors_from_string(text: str) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0] (one factor per rank)."""
    try:
        return [_check_factor(float(part)) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"bad slowdown list {text!r}: {exc}") from None


def compute_factor_from_env(rank: int, default: float = 1.0) -> float:
    """This rank's factor from ASHL_EMULATE_COMPUTE='f0,f1,...' (missing ranks: default)."""
    text = os.environ.get(ENV_COMPUTE, "")
    factors = factors_from_string(text) if text.strip() else []
    return factors[rank] if rank < len(factors) else _check_factor(default)


# --- a rank's emulated hardware: compute and link -----------------------------------

ENV_LINK = "ASHL_EMULATE_LINK"          # 'f0,f1,...': link slowdown factor per rank
ENV_LINK_BASE = "ASHL_EMULATE_LINK_BASE"  # 'LATENCY_S,BYTES_PER_S' of a factor-1 link


@dataclass(frozen=True)
class Link:
    """An emulated link: a message of B bytes arrives latency_s + B / bytes_per_s after it
    was sent."""
    latency_s: float
    bytes_per_s: float

    def __post_init__(self):
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"link latency must be a finite number >= 0 s, got {self.latency_s!r}")
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise ValueError(f"link bandwidth must be a finite number > 0 bytes/s, "
                             f"got {self.bytes_per_s!r}")

    def delay(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def slowed(self, factor: float) -> "Link":
        """The same link `factor` times slower: latency x factor, bandwidth / factor."""
        factor = _check_factor(factor)
        return Link(self.latency_s * factor, self.bytes_per_s / factor)


# A factor-1 link: 1 Gbit/s with 0.5 ms latency (a datacentre Ethernet link).
DEFAULT_LINK = Link(5e-4, 125e6)


@dataclass(frozen=True)
class Heterogeneity:
    """What one rank emulates: each local step takes compute_factor times its real time;
    every message it sends or receives is delayed by `link` (None: the real network only);
    with `step_s` a step lasts compute_factor x step_s of wall time instead."""
    compute_factor: float = 1.0
    link: Optional[Link] = None
    step_s: Optional[float] = None

    def __post_init__(self):
        _check_factor(self.compute_factor)
        _check_step_time(self.step_s)

    @property
    def active(self) -> bool:
        return self.compute_factor != 1.0 or self.link is not None or self.step_s is not None

    def slowdown(self) -> Optional[ComputeSlowdown]:
        """This rank's step stretcher, or None when its steps run at their real speed."""
        if self.compute_factor == 1.0 and self.step_s is None:
            return None
        return ComputeSlowdown(self.compute_factor, step_s=self.step_s)

    def link_delay(self, nbytes: int) -> float:
        return 0.0 if self.link is None else self.link.delay(nbytes)

    def depart(self, nbytes: int, overlapped_s: float = 0.0) -> None:
        """An emulated slow link: a message leaves only after its transfer time, less the
        `overlapped_s` of it that already ran beside compute."""
        delay = self.link_delay(nbytes) - overlapped_s
        if delay > 0:
            time.sleep(delay)

    def arrival(self, sent_at: float, nbytes: int) -> float:
        """When a message sent at `sent_at` (time.monotonic, host-wide) of `nbytes` is
        delivered (an overlapped commit's reply is taken only from then on); 0, at once,
        without an emulated link (the sender's clock may be another host's)."""
        return 0.0 if self.link is None else sent_at + self.link_delay(nbytes)

    def arrive(self, sent_at: float, nbytes: int) -> None:
        """An emulated slow link: a message sent at `sent_at` (time.monotonic, host-wide) is
        not delivered before sent_at + its transfer time."""
        if self.link is not None:
            sleep_until(sent_at + self.link_delay(nbytes))

    @classmethod
    def for_rank(cls, rank: int, compute: Sequence[float] = (), link: Sequence[float] = (),
                 base: Link = DEFAULT_LINK, step_s: Optional[float] = None) -> "Heterogeneity":
        """Rank `rank`'s share of per-rank factor lists (a missing rank gets factor 1; an
        empty link list means no link emulation)."""
        c = _check_factor(compute[rank]) if rank < len(compute) else 1.0
        if not link:
            return cls(c, None, step_s)
        f = _check_factor(link[rank]) if rank < len(link) else 1.0
        return cls(c, base.slowed(f), step_s)

    @classmethod
    def from_env(cls, rank: int) -> "Heterogeneity":
        """From ASHL_EMULATE_COMPUTE / ASHL_EMULATE_LINK / ASHL_EMULATE_LINK_BASE /
        ASHL_EMULATE_STEP_TIME, so a benchmark can slow any script's ranks without touching
        it."""
        compute = factors_from_string(os.environ.get(ENV_COMPUTE, ""))
        link = factors_from_string(os.environ.get(ENV_LINK, ""))
        base = DEFAULT_LINK
        text = os.environ.get(ENV_LINK_BASE, "").strip()
        if text:
            try:
                latency, bw = (float(x) for x in text.split(","))
            except ValueError:
                raise ValueError(f"{ENV_LINK_BASE}={text!r}: expected 'LATENCY_S,BYTES_PER_S'") from None
            base = Link(latency, bw)
        return cls.for_rank(rank, compute, link, base, step_time_from_env())


def sleep_until(deadline: float, clock: Callable[[], float] = time.monotonic) -> float:
    """Sleep until clock() >= deadline (a shared, system-wide monotonic clock); returns the
    seconds slept."""
    waited = 0.0
    while True:
        left = deadline - clock()
        if left <= 0:
            return waited
        time.sleep(left)
        waited += left
