"""``async-localsgd``: Asynchronous Local-SGD (Liu et al. 2024) through ashl's parameter server.

* Dynamic Local Updates (DyLU): every rank times ``profile_steps`` steps; the server rank
  gives rank i H_i = floor(v_i / v_max * H) local steps a round (v = 1 / step time,
  ``planner.dylu_steps``; H = ``local_steps``, default 8) and a data share in proportion
  to H_i, so every rank's round lasts about as long as the fastest rank's.
* Asynchronous commits: a rank commits after its H_i steps and continues from the reply's
  global model; nobody waits for anybody (one stage, the server's unbounded one).
* Delayed Nesterov on the server (outer.py, ``delayed-nesterov(0.7, 0.5, n)``, n = the rank
  count): each arriving pseudo-gradient is applied with plain outer SGD at once (merge weight
  1/n, no staleness damping), and every n arrivals one Nesterov momentum step on their sum.

Choices the paper leaves open, made here: H_i comes from the profiled speeds once (no
re-planning; the paper measures speeds ahead of training too); the data shares follow H_i
(the paper samples data shards per worker); the outer learning rate is DiLoCo's 0.7 and the
outer momentum 0.5, not DiLoCo's 0.9: with 0.9, 4 of 5 runs of the digits MLP on 3 ranks
(inner SGD with momentum 0.9) collapsed to chance within seconds; with 0.5 all 4 tried
reached their target (docs/ALGORITHM.md §8). ``outer_optimizer=`` replaces them. Everything
else (the commit, the reply, the end, checkpoints with the outer optimizer's momentum) is
parameter_server.py's.
"""
from __future__ import annotations

from .. import protocol
from ..coordinator import DriftConfig
from ..planner import check_local_steps, dylu_plan
from ..stages import Stage
from .parameter_server import ServerStrategy
from .ps_baselines import without_switch


class AsyncLocalSgdStrategy(ServerStrategy):
    name = "async-localsgd"
    single_stage = True
    profiled = True
    steps_while_others_profile = True
    default_outer = "delayed-nesterov(0.7, 0.5)"

    def __init__(self, model, params, *, local_steps: int = 8, stage_config=None, **kwargs):
        check_local_steps(local_steps)
        for ignored in ("planner_config", "drift_config", "staleness", "bound"):
            kwargs.pop(ignored, None)   # DyLU plans; no damping, no bound, no re-plan
        super().__init__(model, params, staleness="none", stage_config=without_switch(stage_config),
                         drift_config=DriftConfig(enabled=False), **kwargs)
        self.H = local_steps

    def _make_plan(self) -> None:
        """Collective: every rank's profile; DyLU's plan on the server rank, broadcast; the
        server starts in its one (unbounded) stage before anyone commits."""
        profile = self.measured_profile(self.mc, protocol.HEADER_SIZE + 4 * self.numel)
        if self.is_server:
            self._start_server(self.flat_model(self.anchors))
        profiles = self.mc.gather_profiles(profile, self.current_epoch())
        plan = None
        if self.is_server:
            plan = dylu_plan(profiles, self.H, overlap=self.overlap, reason=(
                f"async-localsgd: DyLU from profiled speeds, H={self.H}, outer "
                f"{self.server.server.outer.spec}"))
            with self.mc.lock:
                self.mc.coordinator.start(plan, Stage.AHL, reason=plan.reason)
        plan = self.mc.broadcast_plan(plan)
        if self.server is not None:
            self.server.start()
        self.stage = Stage.AHL
        self.shares_epoch = self.mc.shares_epoch
        self.adopt_plan(plan)

    def plan_for_survivors(self, profiles):
        """DyLU among the ranks left: the outer step averages their n pseudo-gradients."""
        return dylu_plan(profiles, self.H, reason=self.name, overlap=self.overlap)

    def counters(self) -> dict:
        c = super().counters()
        c["local_steps_max"] = self.H
        return c
