"""``adsp``: ADSP (Hu et al., "Distributed Machine Learning through Heterogeneous Edge
Systems", AAAI'20) as ITS AUTHORS' CODE does it (joapolarbear/adsp, ``cifar10/strain.py``),
not the ASHL authors' copy (docs/ALGORITHM.md, F25, lists that copy's bugs: a reward that
is identically 1, no local updates, the learning rate applied twice).

Workers never wait. Each trains continuously with local optimizer steps and, every
``interval`` seconds of wall time, commits its accumulated update U_i = w_i - w_i(last pull)
to the parameter server, which adds U_i / M (M = number of workers) and answers with the
global model:

    interval = max(min_commit_interval_s, check_period_s / c_target - last commit's duration)

``c_target`` (commits per check period, the same for every worker) is chosen online by a
scheduler on the server rank (``CommitRateSearch``, pure): at the start, every
``research_every_s``, and whenever the global loss rose by >= ``jump`` (30 %) over one check
period, it runs c_target and c_target + 1 for one check period each, samples the global loss
at the start, the middle and the end of each period, fits

    loss(t) = 1 / (a^2 t + b) + c             (scipy.optimize.curve_fit as the authors,
                                              or an exact/least-squares fit in numpy)

and scores the period with the reward a^2 / (1/(loss_target - c) - b) = 1 / (predicted time
at which the loss reaches loss_target); it keeps increasing c_target while the reward
improves and settles on the last improving value. The new c_target reaches a worker with
its next commit.

Time constants, scaled to small test models (the authors': check period 60 s, minimum
commit interval 10 s, a new search every 1000 s); all are options:
    check_period_s = 2.0            one trial of the search; loss checks between searches
    min_commit_interval_s = None    default check_period_s / 6   (the authors' 10 s / 60 s)
    research_every_s = None         default check_period_s * 1000 / 60
    loss_target = None              the reward's target loss; default stage_config.target_loss,
                                    else 0.0 (the authors' default ``training_end``)
    c_init = 1                      the authors' starting c_target
    c_max = None                    default check_period_s / min_commit_interval_s (beyond it
                                    the interval is already at its minimum)
    jump = 0.3

What differs from the authors' code, deliberately:
  * The global loss is ASHL's G (the share-weighted running training loss the ranks send
    with their commits; stages.py), not a test-set evaluation by the server; the user's
    ``evaluate`` callback still drives a target-accuracy stop, as for every strategy.
  * The authors stop every worker (a barrier at their next commit) before a search and
    between its trials; here nobody ever waits: the new c_target reaches each worker with
    its next commit, at most one interval late. Trials are timed on the server's clock.
  * A fit that fails or predicts that the target is never reached scores 0 (infinitely
    far), one that says it is already reached scores +inf, instead of the authors' sentinel
    values (-100000) and unguarded divisions.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

from ..stages import Stage
from ..planner import uniform_plan
from .ps_baselines import PSBaseline
from .runtime import world_comm

__all__ = ["fit_loss_curve", "adsp_reward", "CommitRateSearch", "AdspStrategy"]



# ------------------------------------------------------------------ the curve fit (pure)

def _exact_fit(t: Sequence[float], l: Sequence[float]) -> Optional[tuple[float, float, float]]:
    """The curve through three points: 1/(l_i - c) is linear in t_i; solve for c."""
    (t0, t1, t2), (l0, l1, l2) = t, l
    den = (l1 - l2) * (t1 - t0) - (l0 - l1) * (t2 - t1)
    if den == 0:
        return None
    c = ((l1 - l2) * l0 * (t1 - t0) - (l0 - l1) * l2 * (t2 - t1)) / den
    if any(li == c for li in l) or t1 == t0:
        return None
    a2 = (1 / (l1 - c) - 1 / (l0 - c)) / (t1 - t0)
    b = 1 / (l0 - c) - a2 * t0
    return a2, b, c


def _numpy_fit(t, l, p0) -> Optional[tuple[float, float, float]]:
    """Levenberg-Marquardt on sum (1/(a^2 t + b) + c - l)^2 (no scipy)."""
    import numpy as np
    t, l = np.asarray(t, float), np.asarray(l, float)
    p = np.array(p0, float)

    def residual(p):
        return 1.0 / (p[0] ** 2 * t + p[1]) + p[2] - l

    r = residual(p)
    lam = 1e-3
    for _ in range(200):
        d = p[0] ** 2 * t + p[1]
        jac = np.stack([-2 * p[0] * t / d ** 2, -1 / d ** 2, np.ones_like(t)], axis=1)
        g = jac.T @ jac
        step = np.linalg.solve(g + lam * np.diag(np.diag(g) + 1e-12), -jac.T @ r)
        trial = residual(p + step)
        if np.all(np.isfinite(trial)) and trial @ trial < r @ r:
            p, r, lam = p + step, trial, lam / 3
            if np.linalg.norm(step) < 1e-12 * (1 + np.linalg.norm(p)):
                break
        else:
            lam *= 10
            if lam > 1e12:
                break
    return (float(p[0] ** 2), float(p[1]), float(p[2])) if np.all(np.isfinite(p)) else None


def fit_loss_curve(t: Sequence[float], loss: Sequence[float], use_scipy: bool = True
                   ) -> Optional[tuple[float, float, float]]:
    """Fit loss(t) = 1/(a^2 t + b) + c to >= 3 samples; returns (a^2, b, c) or None.

    scipy.optimize.curve_fit (as ADSP's authors) when scipy is importable and `use_scipy`,
    started from the exact three-point solution; otherwise that exact solution (three
    points) or a small Levenberg-Marquardt least-squares fit in numpy (more points)."""
    if len(t) != len(loss) or len(t) < 3:
        raise ValueError(f"need >= 3 (time, loss) samples, got {len(t)} and {len(loss)}")
    pts = [(float(a), float(b)) for a, b in zip(t, loss)]
    if not all(math.isfinite(a) and math.isfinite(b) for a, b in pts):
        return None
    ts, ls = [p[0] for p in pts], [p[1] for p in pts]
    mid = len(ts) // 2
    exact = _exact_fit([ts[0], ts[mid], ts[-1]], [ls[0], ls[mid], ls[-1]])
    p0 = (1.0, 1.0, 1.0)
    if exact is not None and exact[0] > 0:
        p0 = (math.sqrt(exact[0]), exact[1], exact[2])
    if use_scipy:
        try:
            from scipy.optimize import curve_fit
        except ImportError:
            use_scipy = False
    if use_scipy:
        import warnings
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                popt, _ = curve_fit(lambda x, a, b, c: 1.0 / (a * a * x + b) + c, ts, ls,
                                    p0=p0, maxfev=20000)
        except (RuntimeError, ValueError, ZeroDivisionError, OverflowError):
            return exact if exact is not None and exact[0] >= 0 else None
        a, b, c = (float(x) for x in popt)
        return (a * a, b, c) if all(map(math.isfinite, (a, b, c))) else None
    if len(ts) == 3 and exact is not None and exact[0] >= 0:
        return exact
    return _numpy_fit(ts, ls, p0)


def adsp_reward(fit: Optional[tuple[float, float, float]], loss_target: float) -> float:
    """a^2 / (1/(loss_target - c) - b): 1 / (the time at which the fitted curve reaches
    loss_target). 0 if it never does (or no fit), +inf if it already has."""
    if fit is None:
        return 0.0
    a2, b, c = fit
    if not a2 > 0 or loss_target <= c:
        return 0.0                      # flat or rising, or the asymptote is above the target
    denom = 1.0 / (loss_target - c) - b  # = a^2 * t_target
    if denom <= 0:
        return math.inf
    return a2 / denom


# ------------------------------------------------------------ the commit-rate search (pure)

@dataclass
class Trial:
    c_target: int
    started_at: float
    samples: list            # [(t, loss)]: the start (the previous end), middle, end
    reward: Optional[float] = None


class CommitRateSearch:
    """ADSP's scheduler, fed with (now, global loss) readings; ``update`` returns the
    c_target every worker should use now. Pure: no clock, no MPI."""

    def __init__(self, check_period_s: float, loss_target: float = 0.0, *, c_init: int = 1,
                 c_max: Optional[int] = None, research_every_s: Optional[float] = None,
                 jump: float = 0.3, use_scipy: bool = True):
        if not (check_period_s > 0 and math.isfinite(check_period_s)):
            raise ValueError(f"check_period_s must be a finite number > 0, got {check_period_s!r}")
        if not isinstance(c_init, int) or c_init < 1:
            raise ValueError(f"c_init must be an integer >= 1, got {c_init!r}")
        if c_max is not None and c_max < c_init:
            raise ValueError(f"c_max ({c_max}) must be >= c_init ({c_init})")
        self.period = float(check_period_s)
        self.loss_target = float(loss_target)
        self.c_target = c_init
        self.c_max = c_max
        self.research_every = (self.period * 1000 / 60 if research_every_s is None
                               else float(research_every_s))
        self.jump = jump
        self.use_scipy = use_scipy
        self.phase = "start"        # start -> search -> run -> search -> ...
        self.base = c_init          # the best c_target of the search so far
        self.best_reward: Optional[float] = None
        self.trial: Optional[Trial] = None
        self.searches = 0
        self.searched_at = 0.0
        self.next_check = 0.0
        self.last_check_loss: Optional[float] = None
        self.trials: list[dict] = []       # every finished trial: c_target, reward, samples
        self.decisions: list[dict] = []    # every settled search

    def update(self, now: float, loss: Optional[float]) -> int:
        if loss is None or not math.isfinite(loss):
            return self.c_target
        if self.phase == "start":
            self._start_search(now, loss, "start")
        elif self.phase == "run":
            if now >= self.next_check:
                self.next_check = now + self.period
                last, self.last_check_loss = self.last_check_loss, loss
                if last is not None and last > 0 and (loss - last) / last >= self.jump:
                    self._start_search(now, loss, f"loss jumped {last:.4g} -> {loss:.4g}")
                    return self.c_target
            if now - self.searched_at >= self.research_every:
                self._start_search(now, loss, "periodic search")
        else:
            self._advance(now, loss)
        return self.c_target

    # ------------------------------------------------------------------ internals
    def _start_search(self, now: float, loss: float, why: str) -> None:
        self.searches += 1
        self.phase = "search"
        self.why = why
        self.base = self.c_target
        self.best_reward = None
        self._begin_trial(self.base, now, [(now, loss)])

    def _begin_trial(self, c: int, now: float, samples: list) -> None:
        self.trial = Trial(c_target=c, started_at=now, samples=samples)
        self.c_target = c

    def _advance(self, now: float, loss: float) -> None:
        tr = self.trial
        if len(tr.samples) == 1 and now >= tr.started_at + self.period / 2:
            tr.samples.append((now, loss))
        if len(tr.samples) == 2 and now >= tr.started_at + self.period:
            tr.samples.append((now, loss))
            fit = fit_loss_curve([s[0] for s in tr.samples], [s[1] for s in tr.samples],
                                 use_scipy=self.use_scipy)
            tr.reward = adsp_reward(fit, self.loss_target)
            self.trials.append({"c_target": tr.c_target, "reward": tr.reward,
                                "fit": fit, "samples": list(tr.samples)})
            end = [(now, loss)]
            if self.best_reward is None:              # the trial of c_target itself
                self.best_reward = tr.reward
            elif tr.reward > self.best_reward:        # c_target + 1 is better: go on
                self.best_reward = tr.reward
                self.base = tr.c_target
            else:                                     # it is not: settle on the base
                return self._settle(now, loss)
            nxt = self.base + 1
            if self.c_max is not None and nxt > self.c_max:
                return self._settle(now, loss)
            self._begin_trial(nxt, now, end)

    def _settle(self, now: float, loss: float) -> None:
        self.c_target = self.base
        self.phase = "run"
        self.trial = None
        self.searched_at = now
        self.next_check = now + self.period
        self.last_check_loss = loss
        self.decisions.append({"at_s": now, "c_target": self.base, "reward": self.best_reward,
                               "why": self.why})


# ------------------------------------------------------------------------- the strategy

class AdspStrategy(PSBaseline):
    """ADSP through the parameter-server engine: time-based commits, W += U_i / M."""

    name = "adsp"
    run_stage = Stage.AHL           # unbounded: nobody waits for anybody

    def __init__(self, model, params, *, check_period_s: float = 2.0,
                 min_commit_interval_s: Optional[float] = None,
                 research_every_s: Optional[float] = None, loss_target: Optional[float] = None,
                 c_init: int = 1, c_max: Optional[int] = None, jump: float = 0.3,
                 search: bool = True, comm=None, **kwargs):
        kwargs.pop("merge_weight", None)
        world = world_comm(comm)
        super().__init__(model, params, comm=world, merge_weight=Fraction(1, world.Get_size()),
                         **kwargs)
        self.check_period_s = float(check_period_s)
        self.min_interval = (self.check_period_s / 6 if min_commit_interval_s is None
                             else float(min_commit_interval_s))
        if not self.min_interval > 0:
            raise ValueError(f"min_commit_interval_s must be > 0, got {min_commit_interval_s!r}")
        cfg_target = getattr(kwargs.get("stage_config"), "target_loss", None)
        self.loss_target = float(loss_target if loss_target is not None
                                 else cfg_target if cfg_target is not None else 0.0)
        self.c_target = c_init
        self.search: Optional[CommitRateSearch] = None
        if self.is_server and search:
            cap = c_max if c_max is not None else max(
                c_init, int(self.check_period_s / self.min_interval))
            self.search = CommitRateSearch(self.check_period_s, self.loss_target, c_init=c_init,
                                           c_max=cap, research_every_s=research_every_s,
                                           jump=jump)
        self.last_commit_s = 0.0
        self._last_commit_end = time.perf_counter()
        self._t0 = time.monotonic()
        self._sent_targets = 0

    @property
    def interval(self) -> float:
        return max(self.min_interval, self.check_period_s / self.c_target - self.last_commit_s)

    def _round_done(self) -> bool:
        if self.stage == Stage.PROFILE:
            return True             # the first step: the plan, then the first commit
        return time.perf_counter() - self._last_commit_end >= self.interval

    def _exchange(self, final: bool = False) -> None:
        t0 = time.perf_counter()
        super()._exchange(final)
        now = time.perf_counter()
        self.last_commit_s = now - t0
        self._last_commit_end = now

    def take_commit_rate(self, rate: int) -> None:
        """A worker takes the scheduler's c_target from the replies to its commits."""
        if not self.is_server and rate > 0:
            self.c_target = rate

    def plan_for_survivors(self, profiles):
        """W += U_i / M over the M workers left."""
        return uniform_plan(len(profiles), self.local_steps_per_commit,
                            Fraction(1, len(profiles)), reason=self.name)

    def after_step(self, loss) -> None:
        super().after_step(loss)
        if self.search is not None and not self.finished and self.plan is not None:
            with self.mc.lock:
                g = self.mc.coordinator.machine.global_loss
            c = self.search.update(time.monotonic() - self._t0, g)
            if c != self.c_target:
                self.c_target = c
                with self.mc.lock:    # every reply from now on carries it
                    self.server.server.commit_rate = c
                self._sent_targets += 1
                self.timeline.instant("c_target", c_target=c)

    def counters(self) -> dict:
        c = super().counters()
        c.update(c_target=self.c_target, commit_interval_s=self.interval,
                 check_period_s=self.check_period_s)
        if self.search is not None:
            c["search"] = {"searches": self.search.searches, "trials": self.search.trials,
                           "decisions": self.search.decisions,
                           "announcements": self._sent_targets}
        return c
