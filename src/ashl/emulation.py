"""Emulated heterogeneity for tests and benchmarks.

ComputeSlowdown makes a step take `factor` times its real duration: after the real
work it sleeps (factor - 1) * elapsed. The factor may be changed mid-run (drift tests).
A sleep that overshoots (a loaded machine wakes sleepers late) is paid back from the
next step's sleep, so the average step is factor x its real time even under load.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

__all__ = ["ComputeSlowdown", "factors_from_string", "compute_factor_from_env"]

ENV_COMPUTE = "ASHL_EMULATE_COMPUTE"


def _check_factor(factor: float) -> float:
    if (not isinstance(factor, (int, float)) or isinstance(factor, bool)
            or not math.isfinite(factor) or factor < 1):
        raise ValueError(f"slowdown factor must be a finite number >= 1, got {factor!r}")
    return float(factor)


class ComputeSlowdown:
    """`with slowdown: real_step()` -> the block takes `factor` times as long."""

    def __init__(self, factor: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self._factor = _check_factor(factor)
        self.clock, self.sleep = clock, sleep
        self._start: float | None = None
        self._carry = 0.0          # <= 0: oversleep still to be paid back

    @property
    def factor(self) -> float:
        return self._factor

    @factor.setter
    def factor(self, value: float) -> None:
        self._factor = _check_factor(value)

    def __enter__(self) -> "ComputeSlowdown":
        self._start = self.clock()
        return self

    def __exit__(self, *exc: Any) -> None:
        elapsed = self.clock() - self._start
        self._start = None
        extra = (self._factor - 1) * elapsed
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
