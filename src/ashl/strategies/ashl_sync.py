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
"""
from __future__ import annotations

import time

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
