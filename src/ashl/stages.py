"""The run's stage machine, PROFILE -> AHL -> SHL -> DONE, fed with events.

Pure: the caller injects clock readings, loss reports and evaluation results, so the
machine is testable without MPI. The coordinator (rank 0) owns one instance and
answers each commit with the current stage; every rank therefore learns of a stage
change or a stop at its next commit.

Global loss (the switch and target signal), exactly:
    each rank keeps a RunningLoss: per round (the local steps between two commits) the
    arithmetic mean of the training losses its steps returned; across rounds an
    exponential moving average  L_i <- (1 - beta) L_i + beta * round_mean  (beta = 0.5,
    the first round initialises L_i). The rank sends L_i with each commit.
    G = sum_i D_i L_i over the latest L_i of every rank, with D_i the current plan's data
    shares for the current stage. G is undefined (None) until every rank has reported.
It is a training-mode loss on the batches the ranks trained on, with each rank's local
model, not an evaluation of the global model: the 0.3 default threshold is meant for it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Sequence

__all__ = ["Stage", "StageConfig", "Transition", "StageMachine", "RunningLoss"]


class Stage(str, enum.Enum):
    """The run's stage; its value is the name plans and logs use, ``code`` its wire byte."""

    PROFILE = "PROFILE"
    AHL = "AHL"
    SHL = "SHL"
    DONE = "DONE"

    def __str__(self) -> str:
        return self.value

    @property
    def code(self) -> int:
        """The byte a protocol header carries."""
        return _CODES[self]

    @classmethod
    def from_code(cls, code: int) -> "Stage":
        """The stage of a wire byte; ValueError for an unknown one."""
        for stage, c in _CODES.items():
            if c == code:
                return stage
        raise ValueError(f"unknown stage code {code!r}")

    @property
    def training(self) -> bool:
        return self in (Stage.AHL, Stage.SHL)

    @property
    def planned(self) -> "Stage":
        """The stage whose plan applies now: a training stage itself; before and after
        training, AHL (the first plan's numbers)."""
        return self if self.training else Stage.AHL


_CODES = {Stage.PROFILE: 0, Stage.AHL: 1, Stage.SHL: 2, Stage.DONE: 3}


def _optional_positive(name: str, value, integer: bool = False) -> None:
    if value is None:
        return
    if integer:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"stage config: {name} must be None or an integer >= 1, got {value!r}")
    elif (not isinstance(value, (int, float)) or isinstance(value, bool)
          or not math.isfinite(value) or value <= 0):
        raise ValueError(f"stage config: {name} must be None or a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class StageConfig:
    """When to switch and when to stop. Commit counts are totals over all ranks."""

    switch_loss: float = 0.3              # AHL -> SHL once the global loss is below this
    ahl_max_seconds: float | None = None  # AHL budget, from the start of AHL
    ahl_max_commits: int | None = None
    ahl_budget_fraction: float = 0.5      # AHL gets this share of max_seconds / max_commits
    ahl_default_commits_per_rank: int = 500  # AHL budget when no budget is set at all
    target_loss: float | None = None      # DONE once the global loss is <= this
    target_accuracy: float | None = None  # DONE once an evaluation reports >= this
    max_seconds: float | None = None      # DONE after this long, profiling included
    max_commits: int | None = None        # DONE after this many commits (AHL + SHL)
    switch: bool = True                   # False: one training stage until DONE (baselines);
                                          # neither the loss nor an AHL budget moves it

    def __post_init__(self) -> None:
        if not isinstance(self.switch_loss, (int, float)) or not math.isfinite(self.switch_loss):
            raise ValueError(f"stage config: switch_loss must be a finite number, got {self.switch_loss!r}")
        _optional_positive("ahl_max_seconds", self.ahl_max_seconds)
        _optional_positive("ahl_max_commits", self.ahl_max_commits, integer=True)
        _optional_positive("max_seconds", self.max_seconds)
        _optional_positive("max_commits", self.max_commits, integer=True)
        _optional_positive("ahl_default_commits_per_rank", self.ahl_default_commits_per_rank, integer=True)
        if not 0 < self.ahl_budget_fraction <= 1:
            raise ValueError(f"stage config: ahl_budget_fraction must be in (0, 1], got {self.ahl_budget_fraction!r}")
        for name in ("target_loss", "target_accuracy"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)):
                raise ValueError(f"stage config: {name} must be None or a finite number, got {value!r}")

    def can_stop(self, evaluated: bool) -> bool:
        """Can the run stop by itself: a budget, a loss target, or an accuracy target with an
        evaluation callback (`evaluated`) to measure it?"""
        return (any(v is not None for v in (self.target_loss, self.max_seconds, self.max_commits))
                or (evaluated and self.target_accuracy is not None))

    def ahl_budgets(self, n_ranks: int) -> tuple[float | None, int | None]:
        """Effective AHL (seconds, commits). At least one is always set."""
        seconds, commits = self.ahl_max_seconds, self.ahl_max_commits
        if seconds is None and self.max_seconds is not None:
            seconds = self.ahl_budget_fraction * self.max_seconds
        if commits is None and self.max_commits is not None:
            commits = max(1, int(self.ahl_budget_fraction * self.max_commits))
        if seconds is None and commits is None:
            commits = self.ahl_default_commits_per_rank * n_ranks
        return seconds, commits


@dataclass(frozen=True)
class Transition:
    at_s: float           # seconds since the machine started
    commits: int          # total commits seen when it happened
    from_stage: Stage
    to_stage: Stage
    reason: str


class RunningLoss:
    """A rank's running training loss, as sent with its commits (see module doc)."""

    def __init__(self, smoothing: float = 0.5):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = smoothing
        self.value: float | None = None
        self._sum = 0.0
        self._count = 0

    def add(self, loss: float) -> None:
        """One local step's training loss (non-finite values are skipped)."""
        loss = float(loss)
        if math.isfinite(loss):
            self._sum += loss
            self._count += 1

    def commit(self) -> float | None:
        """Fold the round into the average; returns the value to report."""
        if self._count:
            mean = self._sum / self._count
            self.value = mean if self.value is None else (
                (1 - self.smoothing) * self.value + self.smoothing * mean)
        self._sum, self._count = 0.0, 0
        return self.value


@dataclass
class _Counters:
    commits: int = 0
    ahl_commits: int = 0
    ahl_started_at: float | None = None
    per_rank: list = field(default_factory=list)


class StageMachine:
    """Owns the stage; every method takes the current clock reading `now` (seconds)."""

    def __init__(self, n_ranks: int, config: StageConfig | None = None, start_time: float = 0.0):
        if not isinstance(n_ranks, int) or n_ranks < 1:
            raise ValueError(f"n_ranks must be an integer >= 1, got {n_ranks!r}")
        self.n_ranks = n_ranks
        self.config = StageConfig() if config is None else config
        self.start_time = float(start_time)
        self.stage = Stage.PROFILE
        self.stop_reason: str | None = None
        self.transitions: list[Transition] = []
        self._losses: list[float | None] = [None] * n_ranks
        self._weights: tuple[Fraction, ...] = tuple(Fraction(1, n_ranks) for _ in range(n_ranks))
        self._c = _Counters(per_rank=[0] * n_ranks)
        self.last_accuracy: float | None = None
        self._ahl_seconds, self._ahl_commits = self.config.ahl_budgets(n_ranks)

    # ------------------------------------------------------------------ state
    @property
    def done(self) -> bool:
        return self.stage is Stage.DONE

    @property
    def commits(self) -> int:
        return self._c.commits

    def commits_of(self, rank: int) -> int:
        return self._c.per_rank[rank]

    @property
    def global_loss(self) -> float | None:
        """Share-weighted mean of the ranks' latest running losses (None until every rank
        with a share has reported; a rank with none, e.g. one lost, does not count)."""
        counted = [(w, v) for w, v in zip(self._weights, self._losses) if w > 0]
        if any(v is None for _, v in counted):
            return None
        return float(sum(w * Fraction(v) for w, v in counted))

    def set_weights(self, shares: Sequence[Fraction]) -> None:
        """Shares D_i that weight the global loss (the current plan's, current stage)."""
        if len(shares) != self.n_ranks:
            raise ValueError(f"need {self.n_ranks} shares, got {len(shares)}")
        total = sum(Fraction(s) for s in shares)
        if total <= 0:
            raise ValueError("shares must sum to a positive value")
        self._weights = tuple(Fraction(s) / total for s in shares)

    # ----------------------------------------------------------------- events
    def begin_training(self, now: float, reason: str = "profiling finished, plan ready") -> Stage:
        """PROFILE -> AHL (a no-op in any later stage)."""
        if self.stage is Stage.PROFILE:
            self._c.ahl_started_at = now
            self._move(Stage.AHL, now, reason)
            self._check(now)
        return self.stage

    def resume(self, stage: Stage, now: float, reason: str = "resumed from a checkpoint") -> Stage:
        """PROFILE -> ``stage`` (AHL or SHL) for a run continued from a checkpoint (or one
        that starts with a fixed plan and no profiling: ``reason`` says which)."""
        stage = Stage(stage)
        if not stage.training:
            raise ValueError(f"a run resumes in AHL or SHL, not {stage.value}")
        self.begin_training(now, reason=reason)
        if stage is Stage.SHL and self.stage is Stage.AHL:
            self._move(Stage.SHL, now, reason)
        return self.stage

    def commit(self, rank: int, now: float, loss: float | None = None) -> Stage:
        """A commit by `rank` carrying its running training loss."""
        if not 0 <= rank < self.n_ranks:
            raise ValueError(f"rank {rank} out of range for {self.n_ranks} ranks")
        if self.stage in (Stage.AHL, Stage.SHL):
            self._c.commits += 1
            self._c.per_rank[rank] += 1
            if self.stage is Stage.AHL:
                self._c.ahl_commits += 1
        if loss is not None and math.isfinite(loss):
            self._losses[rank] = float(loss)
        self._check(now)
        return self.stage

    def evaluation(self, now: float, loss: float | None = None,
                   accuracy: float | None = None) -> Stage:
        """Result of the optional evaluation callback; only accuracy is used to stop."""
        if accuracy is not None:
            self.last_accuracy = float(accuracy)
        self._check(now)
        return self.stage

    def tick(self, now: float) -> Stage:
        """A clock reading with no other news (checks time budgets)."""
        self._check(now)
        return self.stage

    def stop(self, now: float, reason: str) -> Stage:
        """An external stop (user request, error elsewhere)."""
        if self.stage is not Stage.DONE:
            self._finish(now, reason)
        return self.stage

    def restate_stop(self, reason: str) -> None:
        """The same stop, better explained: the last transition's and the stop's reason."""
        if self.stage is Stage.DONE and self.transitions:
            self.transitions[-1] = replace(self.transitions[-1], reason=reason)
            self.stop_reason = reason

    # --------------------------------------------------------------- internals
    def _move(self, to: Stage, now: float, reason: str) -> None:
        self.transitions.append(Transition(at_s=now - self.start_time, commits=self._c.commits,
                                           from_stage=self.stage, to_stage=to, reason=reason))
        self.stage = to

    def _finish(self, now: float, reason: str) -> None:
        self.stop_reason = reason
        self._move(Stage.DONE, now, reason)

    def _check(self, now: float) -> None:
        if self.stage is Stage.DONE:
            return
        cfg = self.config
        elapsed = now - self.start_time
        loss = self.global_loss
        training = self.stage in (Stage.AHL, Stage.SHL)

        # Stops first: a stop wins over a switch on the same event.
        if cfg.max_seconds is not None and elapsed >= cfg.max_seconds:
            return self._finish(now, f"time budget: {elapsed:.3f} s >= max_seconds {cfg.max_seconds:g}")
        if training and cfg.max_commits is not None and self._c.commits >= cfg.max_commits:
            return self._finish(now, f"commit budget: {self._c.commits} commits >= max_commits {cfg.max_commits}")
        if training and cfg.target_loss is not None and loss is not None and loss <= cfg.target_loss:
            return self._finish(now, f"target loss: global loss {loss:.4g} <= {cfg.target_loss:g}")
        if (training and cfg.target_accuracy is not None and self.last_accuracy is not None
                and self.last_accuracy >= cfg.target_accuracy):
            return self._finish(now, f"target accuracy: {self.last_accuracy:.4g} >= {cfg.target_accuracy:g}")

        if self.stage is Stage.AHL and cfg.switch:
            if loss is not None and loss < cfg.switch_loss:
                return self._move(Stage.SHL, now, f"global loss {loss:.4g} < switch_loss {cfg.switch_loss:g}")
            in_ahl = now - self._c.ahl_started_at
            if self._ahl_seconds is not None and in_ahl >= self._ahl_seconds:
                return self._move(Stage.SHL, now, f"AHL time budget: {in_ahl:.3f} s >= {self._ahl_seconds:g} s")
            if self._ahl_commits is not None and self._c.ahl_commits >= self._ahl_commits:
                return self._move(Stage.SHL, now,
                                  f"AHL commit budget: {self._c.ahl_commits} commits >= {self._ahl_commits}")
