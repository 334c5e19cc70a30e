"""``ashl``: profile, then AHL (dense, asynchronous), then SHL (top-k with error feedback,
bounded staleness), each rank with its own local-step count H_i from the plan, through the
parameter server (parameter_server.py: the commit, the reply, the end, checkpoints).

The server runs as a thread on ``server_rank`` (rank 0 by default) beside that rank's
training; every rank, that one included, commits over MPI point-to-point.
"""
from __future__ import annotations

from .. import protocol
from ..stages import Stage
from .parameter_server import ServerStrategy


class AshlStrategy(ServerStrategy):
    name = "ashl"

    def __init__(self, model, params, *, profile_steps: int = 10, **kwargs):
        if profile_steps < 3:
            raise ValueError(f"profile_steps must be >= 3 (one is warm-up), got {profile_steps}")
        super().__init__(model, params, **kwargs)
        self.profile_steps = profile_steps

    def local_steps_target(self) -> int:
        if self.stage is Stage.PROFILE:
            return self.profile_steps
        return self.plan.local_steps(self.rank, self.stage)

    def _make_plan(self) -> None:
        """Collective: every rank's profile (its timed steps and a measured commit), the plan
        on the server rank, broadcast; the server starts before anyone commits."""
        profile = self.measured_profile(self.mc, protocol.HEADER_SIZE + 4 * self.numel)
        if self.is_server:
            self._start_server(self.flat_model(self.anchors))
        plan = self.mc.establish_plan(profile)
        if self.server is not None:
            self.server.start()
        self.stage = Stage.AHL
        self.adopt_plan(plan)
