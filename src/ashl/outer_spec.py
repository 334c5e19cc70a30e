"""How an outer optimizer is spelled (``outer_optimizer=``, ``--outer-optimizer``), parsed and
checked; the rules themselves are outer.py's. Pure: no torch, so the command lines can check
a spelling before anything starts.

    none | nesterov | nesterov(lr, momentum)
         | delayed-nesterov | delayed-nesterov(lr, momentum) | delayed-nesterov(lr, momentum, n)
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["OuterSpec", "OuterSpecError", "parse_outer", "resolve_outer", "DEFAULT_LR",
           "DEFAULT_MOMENTUM"]

DEFAULT_LR, DEFAULT_MOMENTUM = 0.7, 0.9     # DiLoCo's outer Nesterov (Douillard et al.)
_SPEC = re.compile(r"^\s*(none|nesterov|delayed-nesterov)\s*(?:\(([^)]*)\))?\s*$")
_ARITY = {"none": 0, "nesterov": 2, "delayed-nesterov": 3}


class OuterSpecError(ValueError):
    """A bad spelling: ``outer_optimizer 'SPEC': WHY``; ``why`` alone for a command line."""

    def __init__(self, spec, why: str):
        super().__init__(f"outer_optimizer {spec!r}: {why}")
        self.why = why


@dataclass(frozen=True)
class OuterSpec:
    kind: str = "none"
    lr: float = DEFAULT_LR
    momentum: float = DEFAULT_MOMENTUM
    n: Optional[int] = None          # delayed-nesterov: None = the updates of one round

    def __str__(self) -> str:
        """The spelling parse_outer reads back to this spec, exactly."""
        if self.kind == "none":
            return "none"
        n = "" if self.n is None else f", {self.n}"
        return f"{self.kind}({_number(self.lr)}, {_number(self.momentum)}{n})"


def _number(x: float) -> str:
    """0.7 as '0.7', 1 as '1', and every other float in as few digits as round-trip."""
    return f"{x:g}" if float(f"{x:g}") == x else repr(x)


def parse_outer(spec: "str | OuterSpec | None") -> OuterSpec:
    """``"none"``, ``"nesterov"`` / ``"nesterov(lr, momentum)"``, ``"delayed-nesterov"`` /
    ``"delayed-nesterov(lr, momentum)"`` / ``"delayed-nesterov(lr, momentum, n)"``;
    arguments left out take DiLoCo's lr 0.7, momentum 0.9 and n = one round's updates."""
    if spec is None:
        return OuterSpec()
    if isinstance(spec, OuterSpec):
        return spec
    m = _SPEC.match(str(spec))
    if not m:
        raise OuterSpecError(spec, "expected none, nesterov(lr, momentum) or "
                                   "delayed-nesterov(lr, momentum, n)")
    kind, text = m.group(1), m.group(2)
    args = [x.strip() for x in (text or "").split(",")] if text is not None else []
    if args == [""]:
        args = []
    if kind == "none" and args:
        raise OuterSpecError(spec, "none takes no arguments")
    if args and len(args) not in (2, _ARITY[kind]):
        raise OuterSpecError(spec, f"{kind} takes (lr, momentum)"
                             + (" or (lr, momentum, n)" if kind == "delayed-nesterov" else ""))
    try:
        values = [float(x) for x in args[:2]]
    except ValueError:
        raise OuterSpecError(spec, "lr and momentum must be numbers") from None
    lr, momentum = values if values else (DEFAULT_LR, DEFAULT_MOMENTUM)
    if not (math.isfinite(lr) and lr > 0):
        raise OuterSpecError(spec, "lr must be a finite number > 0")
    if not (math.isfinite(momentum) and 0 <= momentum < 1):
        raise OuterSpecError(spec, "momentum must be in [0, 1)")
    n = None
    if len(args) == 3:
        n = int(args[2]) if args[2].isdigit() else 0
        if n < 1:
            raise OuterSpecError(spec, f"n must be an integer >= 1, got {args[2]!r}")
    return OuterSpec(kind, lr, momentum, n)


def resolve_outer(spec: "str | OuterSpec | None", round_updates: int) -> OuterSpec:
    """`spec` with delayed-nesterov's n filled in: the `round_updates` updates of a round."""
    spec = parse_outer(spec)
    if spec.kind == "delayed-nesterov" and spec.n is None:
        spec = OuterSpec(spec.kind, spec.lr, spec.momentum, int(round_updates))
    return spec
