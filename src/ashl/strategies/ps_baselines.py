"""Parameter-server baselines on ashl's own engine: ``ssp`` (bounded staleness) and ``asp``
(fully asynchronous), and the base of ``adsp``.

They run through the same parameter-server machinery as ``ashl`` (parameter_server.py:
server thread on ``server_rank``, wire protocol, stop rules, timeline, emulated links), with
a fixed plan instead of profiling (``planner.uniform_plan``):

* every rank commits after ONE local step (H = 1: each commit is one minibatch update, as the
  authors' SSP/ASP push one gradient per iteration), dense by default, on an equal data share;
* the server adds the delta with weight 1 (``merge_weight``; not divided by n: every worker's
  update is a full step, as in the authors' SSP/ASP) and no staleness damping;
* one stage for the whole run (``StageConfig.switch = False``): SSP runs in the server's
  bounded stage (SHL: a rank is at most ``bound`` commits ahead of the slowest live rank,
  the authors' "staleness 3"), ASP in the unbounded one (AHL: a reply never waits);
* no profiling, no re-planning.

Deviation from the authors' code (docs/ALGORITHM.md, F25): their workers push the raw gradient
and the server takes a momentum-SGD step; here the worker takes its own optimizer step and pushes
the resulting change of the model (delta of one step). With plain SGD the two coincide; with
momentum the momentum lives on the worker, as in every other strategy here.

``opt.stage`` reads "TRAIN" while training and "DONE" at the end.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Optional

from ..coordinator import DriftConfig
from ..planner import uniform_plan
from ..stages import Stage, StageConfig
from .parameter_server import ServerStrategy


def without_switch(config: Optional[StageConfig]) -> StageConfig:
    """The user's stop rules with the AHL -> SHL switch turned off."""
    return dataclasses.replace(StageConfig() if config is None else config, switch=False)


class PSBaseline(ServerStrategy):
    """A fixed-plan, single-stage run of the parameter-server engine."""

    single_stage = True
    run_stage = Stage.AHL           # the server's stage: AHL unbounded, SHL bounded
    local_steps_per_commit = 1

    def __init__(self, model, params, *, stage_config=None, merge_weight: Optional[Fraction] = None,
                 **kwargs):
        for ignored in ("profile_steps", "planner_config", "drift_config"):
            kwargs.pop(ignored, None)   # nothing to profile, plan or damp
        super().__init__(model, params, staleness="none", stage_config=without_switch(stage_config),
                         drift_config=DriftConfig(enabled=False), **kwargs)
        self.merge_weight = Fraction(1) if merge_weight is None else Fraction(merge_weight)

    def local_steps_target(self) -> int:
        return self.local_steps_per_commit

    def plan_for_survivors(self, profiles):
        """The same fixed plan over the ranks left (equal shares among them)."""
        return uniform_plan(len(profiles), self.local_steps_per_commit, self.merge_weight,
                            reason=self.name)

    def _make_plan(self) -> None:
        """No profiling: every rank builds the same fixed plan; the server rank starts the
        server and the coordinator in the run's single stage. Not collective (a commit
        that reaches the server first just waits in MPI's queue)."""
        plan = uniform_plan(self.size, self.local_steps_per_commit, self.merge_weight,
                            reason=f"{self.name}: fixed plan, H={self.local_steps_per_commit}, "
                                   f"merge weight {self.merge_weight}")
        if self.is_server:
            self._start_server(self.flat_model(self.anchors))
            with self.mc.lock:
                self.mc.coordinator.start(plan, self.run_stage, reason=plan.reason)
            self.server.start()
        self.mc.plan = plan
        self.stage = self.run_stage
        self.adopt_plan(plan)


class SspStrategy(PSBaseline):
    """Stale-synchronous parallel: one step per commit, a rank at most ``bound``
    (``DistributedOptimizer(staleness=s)``, default 3) commits ahead of the slowest."""

    name = "ssp"
    run_stage = Stage.SHL


class AspStrategy(PSBaseline):
    """Asynchronous parallel: one step per commit, merged on arrival, nobody ever waits."""

    name = "asp"
    run_stage = Stage.AHL
