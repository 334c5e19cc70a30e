"""``ashl-sync``: ASHL without a server. The same per-rank H_i and data shares as ``ashl``,
but every round ends in ONE in-place ``hvd.allreduce_`` of share-weighted deltas
(averaging.py). For clusters where a central parameter server would be the bottleneck.

Differences from strategy "ashl":
  * SHL is dense: SHL uses the SHL stage's H_i (k_SHL), shares and merge weights, but no
    top-k compression and no staleness bound (a synchronous round has no staleness).
  * No re-planning: ``drift_config`` is accepted (and handed to the profiling coordinator)
    but ignored; the first plan holds for the whole run.
  * The profiling round (``profile_steps`` equal steps on equal shares) is merged with
    uniform weights 1/size, because every rank did the same work in it.
  * Checkpoints as localsgd's (averaging.py), with the plan and the stage: a resumed run
    goes on in its stage with its plan, without profiling again.
"""
from __future__ import annotations

import time

from ..planner import Plan
from ..stages import Stage
from .averaging import ModelAveragingStrategy


class AshlSyncStrategy(ModelAveragingStrategy):
    name = "ashl-sync"

    profiled = True

    def merge_weight(self, stage: Stage) -> float:
        if stage is Stage.PROFILE:
            return 1.0 / self.size
        return float(self.plan.stage(stage).merge_weights[self.rank])

    def _make_plan(self) -> None:
        """Collective: measure the link with the dense payload, plan on rank 0, broadcast.
        The stage stays PROFILE for the round that ends now (the profiling steps, merged
        with uniform weights); the machines enter AHL when that round's numbers arrive."""
        profile = self.measured_profile(self.mc, 4 * self.numel)
        plan = self.mc.establish_plan(profile)
        self.plan_t = time.monotonic() - self.t0
        self.adopt_plan(plan)

    # --------------------------------------------------------------------- checkpoints
    def _run_record(self) -> dict:
        if self.plan is None:
            raise RuntimeError("nothing to checkpoint before profiling has produced a plan")
        stage = self.stage if self.stage.training else next(   # ended: resume where it ended
            (t.from_stage for t in reversed(self._machine.transitions) if t.from_stage.training),
            Stage.AHL)
        return {"plan": self.plan.to_dict(), "stage": stage.value}

    def _check_run_record(self, run: dict, path: str) -> tuple[Plan, Stage]:
        try:
            plan, stage = Plan.from_dict(run["plan"]), Stage(run["stage"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"checkpoint {path}: its plan or stage cannot be read by this "
                             f"version of ashl ({e}); resume it with the version that saved "
                             "it") from None
        if len(plan.profiles) != self.size or not stage.training:
            raise ValueError(f"checkpoint {path}: a plan for {len(plan.profiles)} ranks in "
                             f"stage {stage.value}; this job has {self.size} ranks")
        return plan, stage

    def _start(self) -> None:
        super()._start()
        if self._resumed is None:
            return
        # every rank read the same file: the same plan and stage everywhere, no collective
        (plan, stage), self._resumed = self._resumed, None
        self.planned = True
        self.adopt_plan(plan)
        # at the run's start (0 on the run's clock, the same on every rank): its time budgets
        # count from there, as decide() then reads the clock
        self._machine.resume(stage, 0.0)
        self._follow_machine(self._machine)
