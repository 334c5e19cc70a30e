"""How much a stale delta counts: factor(s) for a delta computed s global versions ago.

Spelled as strings so they travel in configs and on the command line:
``none`` (always 1), ``polynomial(a)`` = (1 + s)^-a, ``hinge(a, b)`` = 1 for s <= b, else
1 / (a (s - b) + 1) (the two damping rules of FedAsync, Xie et al. 2019).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SPEC = re.compile(r"^\s*(none|polynomial|hinge)\s*(?:\(([^)]*)\))?\s*$")


@dataclass(frozen=True)
class Staleness:
    kind: str = "none"
    a: float = 0.0
    b: float = 0.0

    def __call__(self, s: int) -> float:
        if s < 0:
            raise ValueError(f"staleness must be >= 0, got {s}")
        if self.kind == "none":
            return 1.0
        if self.kind == "polynomial":
            return (1.0 + s) ** -self.a
        return 1.0 if s <= self.b else 1.0 / (self.a * (s - self.b) + 1.0)

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "polynomial":
            return f"polynomial({self.a:g})"
        return f"hinge({self.a:g}, {self.b:g})"


def parse_staleness(spec: "str | Staleness") -> Staleness:
    """``"none"``, ``"polynomial(0.5)"`` or ``"hinge(10, 4)"`` -> Staleness."""
    if isinstance(spec, Staleness):
        return spec
    m = _SPEC.match(str(spec))
    if not m:
        raise ValueError(f"staleness function {spec!r}: expected none, polynomial(a) or hinge(a, b)")
    kind, args = m.group(1), [x.strip() for x in (m.group(2) or "").split(",") if x.strip()]
    try:
        values = [float(x) for x in args]
    except ValueError:
        raise ValueError(f"staleness function {spec!r}: arguments must be numbers") from None
    want = {"none": 0, "polynomial": 1, "hinge": 2}[kind]
    if len(values) != want:
        raise ValueError(f"staleness function {spec!r}: {kind} takes {want} argument(s)")
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"staleness function {spec!r}: arguments must be finite and >= 0")
    return Staleness(kind, *values)
