"""Turns measured per-rank speeds into a plan: local steps, compression, data shares.

Pure: no MPI, no torch. Everything here is a function of its arguments, so the same
profiles and config give the same plan on every machine. docs/PLANNER.md has the
formulas with a worked example; docs/ALGORITHM.md sections 3 and 9 (F1-F25) explain which
of the authors' rules are kept and which are fixed.

Per rank i (all times in seconds):
    c_i   compute time of one local step
    u_i   dense push time (or a latency + bandwidth model and the dense payload size)
    d_i   pull time (always dense)
    g_i   compression time, measured on the rank's tensors (charged only in stages that
          compress)

For a stage with bottleneck count k and target ratio r0:
    C_i = push_i(r0) + d_i                       the commit's round trip
    G_i = g_i if r0 < 1 else 0                   the rank's own work on it
    T   = max_j (k c_j + G_j + C_j)              the bottleneck's round
    H_i = max(k, floor((T - G_i - C_i) / c_i))   floor: nobody's round exceeds T
    R_i = the ratio whose push fills the rest of T, clipped to [r0, 1]
    D_i = H_i / sum_j H_j                        exact fraction

With overlapped commits (``PlannerConfig.overlap``) a rank's next round's steps run while its
commit travels, so its round costs G_i + max(H c_i, C_i) instead of H c_i + G_i + C_i
(``round_seconds``): T = max_j (G_j + max(k c_j, C_j)), H_i = max(k, floor((T - G_i) / c_i))
(the bottleneck too: a link-bound round has room for more steps), and only G_i and the
communication not hidden behind the steps count against the budget (``exposed_comm``).
G_i is never hidden: the rank compresses on the thread that takes its steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterable, Mapping, Sequence

from .stages import Stage

__all__ = [
    "AHL",
    "SHL",
    "STAGES",
    "WEIGHTINGS",
    "ROUNDINGS",
    "SHARE_SOURCES",
    "RankProfile",
    "PlannerConfig",
    "StagePlan",
    "Plan",
    "make_plan",
    "uniform_plan",
    "check_local_steps",
    "dylu_steps",
    "dylu_plan",
    "plan_stage",
    "push_seconds",
    "pull_seconds",
    "payload_fraction",
    "round_local_steps",
    "round_seconds",
    "steps_that_fit",
    "exposed_comm",
    "largest_remainder",
    "embed_plan",
    "profiles_from_columns",
    "load_profile_document",
    "validate_profiles",
]

# Plans are keyed by the training stages' names (JSON keys "AHL", "SHL").
AHL = Stage.AHL.value
SHL = Stage.SHL.value
STAGES = (AHL, SHL)
WEIGHTINGS = ("data_share", "uniform", "fednova")
ROUNDINGS = ("floor", "half_up", "half_even")
SHARE_SOURCES = ("stage", "shl")

# Relative slack for floor(): (T - C_i)/c_i is mathematically an integer for the
# bottleneck, and float error must not turn 8 into 7.999... -> 7.
_FLOOR_SLACK = 1e-9


# --------------------------------------------------------------------------- inputs


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive(where: str, name: str, value: Any) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {name} must be a finite number > 0, got {value!r}")


def _check_non_negative(where: str, name: str, value: Any) -> None:
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class RankProfile:
    """What one rank measured (seconds), or a link model that predicts its transfers.

    push_s / pull_s are measured dense round trips. When one is missing, the link model
    (latency_s + dense_bytes / bytes_per_s, with dense_bytes from PlannerConfig) predicts it.
    compress_s is optional (0 = not measured or negligible).
    """

    compute_s: float
    push_s: float | None = None
    pull_s: float | None = None
    compress_s: float = 0.0
    latency_s: float | None = None
    bytes_per_s: float | None = None
    name: str = ""

    def with_compute(self, compute_s: float) -> "RankProfile":
        return dataclasses.replace(self, compute_s=float(compute_s))

    def with_link_scaled(self, factor: float) -> "RankProfile":
        """The same rank with every transfer `factor` times slower."""
        _check_positive("link scale", "factor", factor)
        return dataclasses.replace(
            self,
            push_s=None if self.push_s is None else self.push_s * factor,
            pull_s=None if self.pull_s is None else self.pull_s * factor,
            latency_s=None if self.latency_s is None else self.latency_s * factor,
            bytes_per_s=None if self.bytes_per_s is None else self.bytes_per_s / factor,
        )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None and getattr(self, f.name) != ""}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "rank") -> "RankProfile":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                             f"expected some of {', '.join(sorted(known))}")
        if "compute_s" not in data:
            raise ValueError(f"{where}: compute_s is missing")
        return cls(**dict(data))


@dataclass(frozen=True)
class PlannerConfig:
    """Planner knobs. Defaults and the authors' values: docs/ALGORITHM.md section 7."""

    k_ahl: int = 8                      # local steps of the AHL bottleneck (at most)
    k_shl: int = 2                      # local steps of the SHL bottleneck (at most)
    comm_budget: float | None = 0.1     # the bottleneck takes the fewest local steps (<= k) that
                                        # keep its communication within this fraction of its
                                        # round; None: always k (the authors' fixed rule)
    shl_target_ratio: float = 0.1       # r0: top-k ratio of the SHL bottleneck (1 = dense)
    ahl_target_ratio: float = 1.0       # AHL sends dense deltas unless this is < 1
    sparse_bytes_factor: float = 2.0    # kappa: sparse bytes / (ratio * dense bytes); fp32 value + int32 index
    min_ratio: float = 1e-4             # no rank is planned below this ratio
    weighting: str = "data_share"       # merge weights: data_share | uniform | fednova
    share_source: str = "stage"         # shares from each stage's own H, or "shl" for both (authors)
    rounding: str = "floor"             # floor (default) | half_up | half_even (authors' Python round)
    max_h_ahl: int | None = None        # caps on H (None = no cap)
    max_h_shl: int | None = None
    dense_bytes: int | None = None      # dense payload size; needed only for link models
    overlap: bool = False               # commits overlap the next round's steps
    timing_tolerance: float = 0.02      # a rank's steps may outlast the time they fit by this
                                        # fraction, by one step at most: measured speeds 1 : 4
                                        # come out as 1 : 3.999, and flooring 7.999 steps to 7
                                        # idles a rank for a step

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        where = "config"
        for name in ("k_ahl", "k_shl"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
        if self.comm_budget is not None:
            _check_positive(where, "comm_budget", self.comm_budget)
            if self.comm_budget >= 1:
                raise ValueError(f"{where}: comm_budget must be None or in (0, 1), "
                                 f"got {self.comm_budget!r}")
        _check_positive(where, "min_ratio", self.min_ratio)
        if self.min_ratio > 1:
            raise ValueError(f"{where}: min_ratio must be <= 1, got {self.min_ratio!r}")
        for name in ("shl_target_ratio", "ahl_target_ratio"):
            value = getattr(self, name)
            _check_positive(where, name, value)
            if not self.min_ratio <= value <= 1:
                raise ValueError(f"{where}: {name} must be in [min_ratio={self.min_ratio}, 1], got {value!r}")
        _check_positive(where, "sparse_bytes_factor", self.sparse_bytes_factor)
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"{where}: weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.share_source not in SHARE_SOURCES:
            raise ValueError(f"{where}: share_source must be one of {SHARE_SOURCES}, got {self.share_source!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"{where}: rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        for name, k in (("max_h_ahl", self.k_ahl), ("max_h_shl", self.k_shl)):
            cap = getattr(self, name)
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < k):
                raise ValueError(f"{where}: {name} must be None or an integer >= its stage's k ({k}), got {cap!r}")
        if not (_is_number(self.timing_tolerance) and 0 <= self.timing_tolerance < 0.5):
            raise ValueError(f"{where}: timing_tolerance must be a number in [0, 0.5), "
                             f"got {self.timing_tolerance!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"{where}: overlap must be True or False, got {self.overlap!r}")
        if self.dense_bytes is not None:
            if not isinstance(self.dense_bytes, int) or isinstance(self.dense_bytes, bool) or self.dense_bytes <= 0:
                raise ValueError(f"{where}: dense_bytes must be a positive integer, got {self.dense_bytes!r}")

    @classmethod
    def authors(cls, **changes) -> "PlannerConfig":
        """The authors' planning rules (docs/PLANNER.md, "The authors' rules, on request")."""
        rules = dict(share_source="shl", rounding="half_even", sparse_bytes_factor=1.0,
                     comm_budget=None, timing_tolerance=0.0)
        return cls(**{**rules, **changes})

    @property
    def floor_tolerance(self) -> float:
        """The stretch the floor rule allows (the half rules already round to the nearest)."""
        return self.timing_tolerance if self.rounding == "floor" else 0.0

    def stage_params(self, stage: str) -> tuple[int, float, int | None]:
        """(k, target ratio, cap) of a stage."""
        if stage == AHL:
            return self.k_ahl, self.ahl_target_ratio, self.max_h_ahl
        if stage == SHL:
            return self.k_shl, self.shl_target_ratio, self.max_h_shl
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PlannerConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config: unknown field(s) {', '.join(unknown)}")
        return cls(**dict(data))


def validate_profiles(profiles: Sequence[RankProfile], config: PlannerConfig) -> None:
    """Raise ValueError naming the rank and field of the first bad input."""
    if len(profiles) == 0:
        raise ValueError("profiles: need at least one rank, got none")
    for i, p in enumerate(profiles):
        where = f"rank {i}" + (f" ({p.name})" if p.name else "")
        if not isinstance(p, RankProfile):
            raise ValueError(f"{where}: expected a RankProfile, got {type(p).__name__}")
        _check_positive(where, "compute_s", p.compute_s)
        _check_non_negative(where, "compress_s", p.compress_s)
        has_model = p.latency_s is not None or p.bytes_per_s is not None
        if has_model:
            _check_non_negative(where, "latency_s", p.latency_s)
            _check_positive(where, "bytes_per_s", p.bytes_per_s)
        for name in ("push_s", "pull_s"):
            value = getattr(p, name)
            if value is not None:
                _check_positive(where, name, value)
            elif not has_model:
                raise ValueError(f"{where}: {name} is missing and there is no link model "
                                 f"(latency_s, bytes_per_s) to predict it")
            elif config.dense_bytes is None:
                raise ValueError(f"{where}: {name} is predicted from the link model, "
                                 f"which needs config.dense_bytes")


def profiles_from_columns(compute_s: Sequence[float], push_s: Sequence[float] | None = None,
                          pull_s: Sequence[float] | None = None,
                          compress_s: Sequence[float] | None = None,
                          latency_s: Sequence[float] | None = None,
                          bytes_per_s: Sequence[float] | None = None,
                          names: Sequence[str] | None = None) -> list[RankProfile]:
    """Per-field lists (one entry per rank) -> profiles; lengths must agree."""
    columns = {"compute_s": compute_s, "push_s": push_s, "pull_s": pull_s,
               "compress_s": compress_s, "latency_s": latency_s,
               "bytes_per_s": bytes_per_s, "name": names}
    n = len(compute_s)
    if n == 0:
        raise ValueError("profiles: need at least one rank, got none")
    for name, column in columns.items():
        if column is not None and len(column) != n:
            raise ValueError(f"{name} has {len(column)} entries but compute_s has {n} "
                             f"(one entry per rank)")
    profiles = []
    for i in range(n):
        row = {name: column[i] for name, column in columns.items() if column is not None}
        profiles.append(RankProfile.from_dict(row, where=f"rank {i}"))
    return profiles


# ----------------------------------------------------------------- transfer model


def payload_fraction(ratio: float, sparse_bytes_factor: float) -> float:
    """Sparse payload size as a fraction of the dense one.

    A top-k payload at ratio r is kappa*r of the dense bytes; once that reaches the
    dense size a compressor should send dense, so the fraction never exceeds 1.
    """
    if ratio >= 1:
        return 1.0
    return min(1.0, sparse_bytes_factor * ratio)


def _push_parts(p: RankProfile, config: PlannerConfig) -> tuple[float, float]:
    """(fixed latency, dense transfer seconds) of a push."""
    if p.push_s is not None:
        return 0.0, float(p.push_s)
    return float(p.latency_s or 0.0), config.dense_bytes / p.bytes_per_s


def push_seconds(p: RankProfile, ratio: float, config: PlannerConfig) -> float:
    latency, transfer = _push_parts(p, config)
    return latency + transfer * payload_fraction(ratio, config.sparse_bytes_factor)


def pull_seconds(p: RankProfile, config: PlannerConfig) -> float:
    if p.pull_s is not None:
        return float(p.pull_s)
    return float(p.latency_s or 0.0) + config.dense_bytes / p.bytes_per_s


def _ratio_for_budget(p: RankProfile, budget_s: float, floor_ratio: float,
                      config: PlannerConfig) -> float:
    """Largest ratio whose push fits in budget_s, within [floor_ratio, 1]."""
    latency, transfer = _push_parts(p, config)
    if transfer <= 0:
        return 1.0
    fraction = (budget_s - latency) / transfer
    # The dense payload fits: send dense (more information at no extra time).
    if fraction >= 1.0 * (1 - _FLOOR_SLACK):
        return 1.0
    ratio = fraction / config.sparse_bytes_factor
    return min(1.0, max(floor_ratio, config.min_ratio, ratio))


# ----------------------------------------------------------------------- rounding


def round_local_steps(x: float, rule: str = "floor") -> int:
    """The one rounding rule for H (see docs/PLANNER.md).

    floor      largest integer <= x (with 1e-9 relative slack for float error); default,
               so that no rank's round is longer than the bottleneck's
    half_up    floor(x + 0.5)
    half_even  Python's round(), as the authors' code
    """
    if rule == "floor":
        return math.floor(x + _FLOOR_SLACK * max(1.0, abs(x)))
    if rule == "half_up":
        return math.floor(x + 0.5 + _FLOOR_SLACK * max(1.0, abs(x)))
    if rule == "half_even":
        return round(x)
    raise ValueError(f"unknown rounding rule {rule!r}; expected one of {ROUNDINGS}")


def largest_remainder(shares: Sequence[Fraction], total: int) -> tuple[int, ...]:
    """Integers proportional to exact shares that sum to `total`.

    Each rank first gets floor(share * total); the samples left over go one each to the
    ranks with the largest fractional remainders, ties to the lower rank index.
    """
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise ValueError(f"total must be an integer >= 0, got {total!r}")
    if sum(shares) != 1:
        raise ValueError(f"shares must sum to exactly 1, got {sum(shares)}")
    quotas = [Fraction(s) * total for s in shares]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    order = sorted(range(len(shares)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return tuple(counts)


# -------------------------------------------------------------------------- output


def _fraction_str(f: Fraction) -> str:
    return f"{f.numerator}/{f.denominator}"


@dataclass(frozen=True)
class StagePlan:
    """One stage's assignment. Tuples are indexed by rank."""

    stage: str
    k: int
    target_ratio: float
    bottleneck: int                      # rank whose round sets the pace
    local_steps: tuple[int, ...]         # H_i
    ratios: tuple[float, ...]            # R_i (1.0 = dense)
    shares: tuple[Fraction, ...]         # D_i, exact, sum to 1
    merge_weights: tuple[Fraction, ...]  # w_i in W += w_i * delta_i
    rank_round_s: tuple[float, ...]      # predicted round of each rank
    round_s: float                       # predicted round = the longest rank round
    idle_fraction: tuple[float, ...]     # (round_s - rank_round_s[i]) / round_s

    def sample_counts(self, total: int) -> tuple[int, ...]:
        """Integer shard sizes that add up to `total` (largest-remainder rounding)."""
        return largest_remainder(self.shares, total)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shares"] = [_fraction_str(f) for f in self.shares]
        d["merge_weights"] = [_fraction_str(f) for f in self.merge_weights]
        for key in ("local_steps", "ratios", "rank_round_s", "idle_fraction"):
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StagePlan":
        return cls(
            stage=d["stage"], k=int(d["k"]), target_ratio=float(d["target_ratio"]),
            bottleneck=int(d["bottleneck"]),
            local_steps=tuple(int(x) for x in d["local_steps"]),
            ratios=tuple(float(x) for x in d["ratios"]),
            shares=tuple(Fraction(x) for x in d["shares"]),
            merge_weights=tuple(Fraction(x) for x in d["merge_weights"]),
            rank_round_s=tuple(float(x) for x in d["rank_round_s"]),
            round_s=float(d["round_s"]),
            idle_fraction=tuple(float(x) for x in d["idle_fraction"]),
        )


@dataclass(frozen=True)
class Plan:
    """Everything every rank needs to know; identical on all ranks."""

    version: int
    profiles: tuple[RankProfile, ...]    # what this plan assumed
    config: PlannerConfig
    ahl: StagePlan
    shl: StagePlan
    reason: str = ""

    @property
    def n_ranks(self) -> int:
        return len(self.profiles)

    def stage(self, name: "Stage | str") -> StagePlan:
        name = getattr(name, "value", name)   # a Stage member or its name
        if name == AHL:
            return self.ahl
        if name == SHL:
            return self.shl
        raise ValueError(f"no plan for stage {name!r}; plans cover {STAGES}")

    def local_steps(self, rank: int, stage: str) -> int:
        return self.stage(stage).local_steps[rank]

    def ratio(self, rank: int, stage: str) -> float:
        return self.stage(stage).ratios[rank]

    def sample_counts(self, total: int, stage: str = SHL) -> tuple[int, ...]:
        return self.stage(stage).sample_counts(total)

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "reason": self.reason,
            "config": self.config.to_dict(),
            "profiles": [p.to_dict() for p in self.profiles],
            "stages": {AHL: self.ahl.to_dict(), SHL: self.shl.to_dict()},
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        return cls(
            version=int(d["version"]),
            reason=d.get("reason", ""),
            config=PlannerConfig.from_dict(d["config"]),
            profiles=tuple(RankProfile.from_dict(p, where=f"rank {i}")
                           for i, p in enumerate(d["profiles"])),
            ahl=StagePlan.from_dict(d["stages"][AHL]),
            shl=StagePlan.from_dict(d["stages"][SHL]),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


# ------------------------------------------------------------------------ planning


def _merge_weights(shares: Sequence[Fraction], local_steps: Sequence[int],
                   weighting: str) -> tuple[Fraction, ...]:
    n = len(shares)
    if weighting == "data_share":          # the authors: W += D_i * delta_i
        return tuple(shares)
    if weighting == "uniform":
        return tuple(Fraction(1, n) for _ in range(n))
    if weighting == "fednova":
        # FedNova: delta_i / H_i is rank i's average step; rescaling by
        # H_eff = sum_j D_j H_j keeps the step size while removing the bias
        # towards ranks that take more local steps.
        h_eff = sum(s * h for s, h in zip(shares, local_steps))
        return tuple(s * h_eff / h for s, h in zip(shares, local_steps))
    raise ValueError(f"unknown weighting {weighting!r}; expected one of {WEIGHTINGS}")


def round_seconds(steps: int, compute_s: float, comm_s: float, overlap: bool = False,
                  own_s: float = 0.0) -> float:
    """A rank's round: its steps, its own work on the commit (`own_s`: building and
    compressing the delta, on the thread that takes the steps), then the commit's round
    trip; with overlap the trip runs beside the next round's steps, and the rank waits at
    their end only for what is left of it."""
    busy = steps * compute_s
    return own_s + (max(busy, comm_s) if overlap else busy + comm_s)


def steps_that_fit(round_s: float, compute_s: float, comm_s: float, overlap: bool = False,
                   rounding: str = "floor", tolerance: float = 0.0, own_s: float = 0.0) -> int:
    """The most local steps whose round (``round_seconds``) fits in `round_s`; one more when
    it misses by no more than `tolerance` of the steps' time (what measured step times are
    accurate to: 7.999 steps are 8)."""
    room = round_s - own_s - (0.0 if overlap else comm_s)
    x = room / compute_s
    h = round_local_steps(x, rounding)
    up = math.ceil(x)
    return up if h < up <= x * (1 + tolerance) else h


def exposed_comm(steps: int, compute_s: float, comm_s: float, overlap: bool = False,
                 own_s: float = 0.0) -> float:
    """The part of a round that is not steps: the rank's own work on the commit, and the
    communication (all of it, or with overlap what the steps do not hide)."""
    return own_s + (max(0.0, comm_s - steps * compute_s) if overlap else comm_s)


def _zeros_if_none(own: Sequence[float] | None, n: int) -> Sequence[float]:
    return (0.0,) * n if own is None else own


def rank_steps(compute: Sequence[float], comm: Sequence[float], k: int, rounding: str = "floor",
               cap: int | None = None, overlap: bool = False, tolerance: float = 0.0,
               own: Sequence[float] | None = None) -> tuple[int, tuple[int, ...]]:
    """(bottleneck, H): the rank with the longest round at k steps gets k; every other rank
    the most steps (>= k, <= cap) that fit the bottleneck's round (give or take `tolerance`
    of it). With overlap the bottleneck too (its round may be its link's, with room for
    more than k steps). `own`: each rank's own work per commit (``round_seconds``)."""
    own = _zeros_if_none(own, len(compute))
    rounds = [round_seconds(k, c, cm, overlap, o) for c, cm, o in zip(compute, comm, own)]
    b = max(range(len(rounds)), key=lambda i: (rounds[i], -i))
    target = rounds[b]
    steps = []
    for i, (c, cm, o) in enumerate(zip(compute, comm, own)):
        h = k if i == b and not overlap else max(k, steps_that_fit(target, c, cm, overlap,
                                                                   rounding, tolerance, o))
        steps.append(h if cap is None else min(h, cap))
    return b, tuple(steps)


def bottleneck_steps(compute: Sequence[float], comm: Sequence[float], k_max: int,
                     comm_budget: float | None, rounding: str = "floor",
                     cap: int | None = None, overlap: bool = False, tolerance: float = 0.0,
                     own: Sequence[float] | None = None) -> tuple[int, int, tuple[int, ...]]:
    """(k, bottleneck, H): the fewest local steps k <= k_max for the bottleneck such that its
    communication is at most `comm_budget` of its round and no rank, its H_i rounded to whole
    steps, idles for more than `comm_budget` of the round. Cheap communication on equal ranks
    gives k = 1 (a commit every step, as synchronous training); a dear link, or speeds whose
    ratios need more steps to round well, give more, up to k_max. ``comm_budget=None`` is the
    fixed rule: k = k_max."""
    candidates = range(1, k_max + 1) if comm_budget is not None else (k_max,)
    for k in candidates:
        b, steps = rank_steps(compute, comm, k, rounding, cap, overlap, tolerance, own)
        if (comm_budget is None or k == k_max
                or within_budget(compute, comm, b, steps, comm_budget, overlap, own)):
            return k, b, steps
    raise AssertionError("unreachable")   # k_max >= 1 is validated


def within_budget(compute: Sequence[float], comm: Sequence[float], bottleneck: int,
                  steps: Sequence[int], budget: float, overlap: bool = False,
                  own: Sequence[float] | None = None) -> bool:
    """Does the bottleneck's time outside its steps (``exposed_comm``), and every rank's
    idle time, stay within `budget` of the round?"""
    own = _zeros_if_none(own, len(compute))
    rounds = [round_seconds(h, c, cm, overlap, o)
              for h, c, cm, o in zip(steps, compute, comm, own)]
    longest = max(rounds)
    b = bottleneck
    return (exposed_comm(steps[b], compute[b], comm[b], overlap, own[b]) <= budget * rounds[b]
            and all(longest - r <= budget * longest for r in rounds))


def _dense_fits(profiles, compute, pull, k_max, r0, cap, config) -> bool:
    """Do dense commits fit the communication budget, as often as top-k ones would: no
    more of the bottleneck's steps apart (k), and no longer apart in time than the budget
    allows? (With overlap a link-bound round gives the bottleneck more than k steps: dense
    commits can then come less often than top-k ones at the same k.)"""
    budget = config.comm_budget
    if budget is None:
        return False
    overlap = config.overlap

    def plan(comm, own):
        k, b, steps = bottleneck_steps(compute, comm, k_max, budget, config.rounding, cap,
                                       overlap, config.floor_tolerance, own)
        longest = max(round_seconds(h, c, cm, overlap, o)
                      for h, c, cm, o in zip(steps, compute, comm, own))
        return k, b, steps, longest

    dense = [push_seconds(p, 1.0, config) + d for p, d in zip(profiles, pull)]
    sparse = [push_seconds(p, r0, config) + d for p, d in zip(profiles, pull)]
    k, b, steps, round_dense = plan(dense, (0.0,) * len(profiles))
    k_sparse, _, _, round_sparse = plan(sparse, [float(p.compress_s) for p in profiles])
    return (k <= k_sparse and within_budget(compute, dense, b, steps, budget, overlap)
            and round_dense <= round_sparse * (1 + config.floor_tolerance) / (1 - budget))


def plan_stage(profiles: Sequence[RankProfile], config: PlannerConfig, stage: str,
               shares: Sequence[Fraction] | None = None) -> StagePlan:
    """Plan one stage. `shares` overrides the stage's own H-proportional shares."""
    k_max, r0, cap = config.stage_params(stage)
    compute = [float(p.compute_s) for p in profiles]
    pull = [pull_seconds(p, config) for p in profiles]
    if r0 < 1 and _dense_fits(profiles, compute, pull, k_max, r0, cap, config):
        r0 = 1.0      # a dense commit already costs little: top-k would only lose information
    compressing = r0 < 1
    # compressing is the rank's own work, on the thread that takes its steps: never hidden
    compress = [float(p.compress_s) if compressing else 0.0 for p in profiles]
    comm = [push_seconds(p, r0, config) + d for p, d in zip(profiles, pull)]

    overlap = config.overlap
    k, bottleneck, local_steps = bottleneck_steps(compute, comm, k_max, config.comm_budget,
                                                  config.rounding, cap, overlap,
                                                  config.floor_tolerance, compress)

    # The longest round after rounding (only differs from target with half_up/half_even).
    longest = max(round_seconds(h, c, cm, overlap, g)
                  for c, h, cm, g in zip(compute, local_steps, comm, compress))
    ratios = []
    for i, p in enumerate(profiles):
        if not compressing:
            ratios.append(1.0)
        elif i == bottleneck:
            ratios.append(r0)
        else:
            # with overlap the commit's trip has the whole round, beside the steps
            steps_s = 0.0 if overlap else compute[i] * local_steps[i]
            budget = longest - steps_s - pull[i] - compress[i]
            ratios.append(_ratio_for_budget(p, budget, r0, config))
    rank_round = tuple(round_seconds(local_steps[i], compute[i],
                                     push_seconds(p, ratios[i], config) + pull[i], overlap,
                                     compress[i]) for i, p in enumerate(profiles))
    round_s = max(rank_round)
    idle = tuple(max(0.0, (round_s - r) / round_s) for r in rank_round)

    if shares is None:
        total = sum(local_steps)
        shares = tuple(Fraction(h, total) for h in local_steps)
    shares = tuple(shares)
    return StagePlan(
        stage=stage, k=k, target_ratio=float(r0), bottleneck=bottleneck,
        local_steps=tuple(local_steps), ratios=tuple(ratios), shares=shares,
        merge_weights=_merge_weights(shares, local_steps, config.weighting),
        rank_round_s=rank_round, round_s=round_s, idle_fraction=idle,
    )


def make_plan(profiles: Iterable[RankProfile], config: PlannerConfig | None = None, *,
              version: int = 1, reason: str = "") -> Plan:
    """Plan both stages from per-rank profiles (index = rank)."""
    config = PlannerConfig() if config is None else config
    profiles = tuple(profiles)
    validate_profiles(profiles, config)
    shl = plan_stage(profiles, config, SHL)
    ahl = plan_stage(profiles, config, AHL,
                     shares=shl.shares if config.share_source == "shl" else None)
    return Plan(version=version, profiles=profiles, config=config, ahl=ahl, shl=shl,
                reason=reason)


def embed_plan(sub: Plan, live: Sequence[int], profiles: Sequence[RankProfile], *,
               version: int, reason: str = "") -> Plan:
    """A plan made for the ranks `live` (index j of `sub` is rank live[j]) as a plan of all
    len(profiles) ranks: the others take no part (H 0, share 0, merge weight 0). How the
    survivors of a lost rank are planned."""
    live = list(live)
    if len(live) != sub.n_ranks or len(set(live)) != len(live) or not all(
            0 <= r < len(profiles) for r in live):
        raise ValueError(f"live ranks {live} do not fit a plan of {sub.n_ranks} ranks "
                         f"among {len(profiles)}")
    n = len(profiles)

    def spread(values, fill) -> tuple:
        out = [fill] * n
        for j, r in enumerate(live):
            out[r] = values[j]
        return tuple(out)

    def stage(sp: StagePlan) -> StagePlan:
        return dataclasses.replace(
            sp, bottleneck=live[sp.bottleneck], local_steps=spread(sp.local_steps, 0),
            ratios=spread(sp.ratios, 1.0), shares=spread(sp.shares, Fraction(0)),
            merge_weights=spread(sp.merge_weights, Fraction(0)),
            rank_round_s=spread(sp.rank_round_s, 0.0), idle_fraction=spread(sp.idle_fraction, 0.0))

    return Plan(version=version, profiles=tuple(profiles), config=sub.config, ahl=stage(sub.ahl),
                shl=stage(sub.shl), reason=reason)


def check_local_steps(local_steps: Any) -> int:
    """A strategy's fixed H: an integer >= 1 (ValueError naming it otherwise)."""
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
    return local_steps


def uniform_plan(n_ranks: int, local_steps: int, merge_weight: Fraction, *,
                 reason: str = "", version: int = 1) -> Plan:
    """A fixed plan without profiling (the baselines): every rank does `local_steps` steps per
    round in both stages, dense, on an equal data share, merged with `merge_weight`. Its
    profiles are placeholders (1 s per step, free links): nothing was measured."""
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"n_ranks must be an integer >= 1, got {n_ranks!r}")
    check_local_steps(local_steps)
    weight = Fraction(merge_weight)
    if weight <= 0:
        raise ValueError(f"merge_weight must be > 0, got {merge_weight!r}")
    profiles = tuple(RankProfile(compute_s=1.0, push_s=0.0, pull_s=0.0) for _ in range(n_ranks))
    config = PlannerConfig(k_ahl=local_steps, k_shl=local_steps, shl_target_ratio=1.0,
                           weighting="uniform")

    def stage(name: str) -> StagePlan:
        return StagePlan(stage=name, k=local_steps, target_ratio=1.0, bottleneck=0,
                         local_steps=(local_steps,) * n_ranks, ratios=(1.0,) * n_ranks,
                         shares=(Fraction(1, n_ranks),) * n_ranks,
                         merge_weights=(weight,) * n_ranks,
                         rank_round_s=(float(local_steps),) * n_ranks,
                         round_s=float(local_steps), idle_fraction=(0.0,) * n_ranks)

    return Plan(version=version, profiles=profiles, config=config, ahl=stage(AHL),
                shl=stage(SHL), reason=reason)


def dylu_steps(compute_s: Sequence[float], local_steps: int) -> tuple[int, ...]:
    """Dynamic Local Updates (Liu et al. 2024, Async Local-SGD): the fastest rank takes
    `local_steps` (H) steps a round, rank i floor(v_i / v_max * H) with v = 1 / compute_s,
    at least 1, so every rank's round takes about as long as the fastest one's."""
    check_local_steps(local_steps)
    for i, c in enumerate(compute_s):
        _check_positive(f"rank {i}", "compute_s", c)
    fastest = min(compute_s)
    # v_i / v_max = fastest / c_i; the slack keeps an exact ratio from flooring one lower
    return tuple(max(1, math.floor(fastest / c * local_steps * (1 + _FLOOR_SLACK)))
                 for c in compute_s)


def dylu_plan(profiles: Sequence[RankProfile], local_steps: int, *, version: int = 1,
              reason: str = "", overlap: bool = False) -> Plan:
    """async-localsgd's plan: DyLU's H_i (`dylu_steps`), dense, data shares in proportion to
    H_i (the samples each rank takes per round), merge weights 1 / n (the outer optimizer's
    average of n pseudo-gradients); the same in both stages (the strategy has one)."""
    profiles = tuple(profiles)
    n = len(profiles)
    if n < 1:
        raise ValueError("dylu_plan needs at least one rank's profile")
    config = PlannerConfig(k_ahl=local_steps, k_shl=local_steps, shl_target_ratio=1.0,
                           weighting="uniform", overlap=overlap)
    validate_profiles(profiles, config)
    compute = [float(p.compute_s) for p in profiles]
    steps = dylu_steps(compute, local_steps)
    rank_round = tuple(round_seconds(h, c, push_seconds(p, 1.0, config) + pull_seconds(p, config),
                                     overlap) for c, h, p in zip(compute, steps, profiles))
    round_s = max(rank_round)
    total = sum(steps)

    def stage(name: str) -> StagePlan:
        return StagePlan(stage=name, k=local_steps, target_ratio=1.0,
                         bottleneck=max(range(n), key=lambda i: (rank_round[i], -i)),
                         local_steps=steps, ratios=(1.0,) * n,
                         shares=tuple(Fraction(h, total) for h in steps),
                         merge_weights=(Fraction(1, n),) * n, rank_round_s=rank_round,
                         round_s=round_s,
                         idle_fraction=tuple(max(0.0, (round_s - r) / round_s) for r in rank_round))

    return Plan(version=version, profiles=profiles, config=config, ahl=stage(AHL),
                shl=stage(SHL), reason=reason)


def load_profile_document(doc: Mapping[str, Any]) -> tuple[list[RankProfile], PlannerConfig, int | None]:
    """Parse a profile file: {"ranks": [{...}, ...]} or per-field lists under "columns".

    Optional keys: "config" (PlannerConfig fields), "dataset_size" (samples, for shard sizes).
    """
    if not isinstance(doc, Mapping):
        raise ValueError("profile document must be a JSON object")
    config = PlannerConfig.from_dict(doc.get("config", {}))
    if "ranks" in doc:
        ranks = doc["ranks"]
        if not isinstance(ranks, list):
            raise ValueError("ranks must be a list with one object per rank")
        profiles = [RankProfile.from_dict(r, where=f"rank {i}") for i, r in enumerate(ranks)]
    elif "columns" in doc:
        columns = dict(doc["columns"])
        if "name" in columns:
            columns["names"] = columns.pop("name")
        try:
            profiles = profiles_from_columns(**columns)
        except TypeError as exc:
            raise ValueError(f"columns: {exc}") from None
    else:
        raise ValueError('profile document needs "ranks" (a list) or "columns" (per-field lists)')
    validate_profiles(profiles, config)
    size = doc.get("dataset_size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise ValueError(f"dataset_size must be a non-negative integer, got {size!r}")
    return profiles, config, size
