"""``ashl``: profile, then AHL (asynchronous; dense unless the plan or ``compression=`` says
otherwise), then SHL (top-k with error feedback at each rank's planned ratio, bounded
staleness), each rank with its own local-step count H_i from the plan, through the parameter
server (parameter_server.py: the commit, the reply, the end, checkpoints).

The server runs as a thread on ``server_rank`` (rank 0 by default) beside that rank's
training; the ranks commit over the run's transport (that rank in-process).

Commits overlap the next round's steps unless ``overlap=False``: on the benchmark scenario
(docs/BENCHMARKS.md) overlapped ashl delivered 84-85% of the ideal throughput against 80-82%
over six seeds, and reached the target sooner at the median (22.4 s against 24.9 s).
"""
from __future__ import annotations

from .. import protocol
from ..stages import Stage
from .parameter_server import ServerStrategy


class AshlStrategy(ServerStrategy):
    name = "ashl"
    overlaps_by_default = True

    profiled = True
    steps_while_others_profile = True

    def _make_plan(self) -> None:
        """Collective: every rank's profile (its timed steps and a measured commit), the plan
        on the server rank, broadcast; the server starts before anyone commits."""
        profile = self.measured_profile(self.mc, protocol.HEADER_SIZE + 4 * self.numel,
                                        compress=self.compression_samples())
        if self.is_server:
            self._start_server(self.flat_model(self.anchors))
        plan = self.mc.establish_plan(profile, self.current_epoch())
        if self.server is not None:
            self.server.start()
        self.stage = Stage.AHL
        self.shares_epoch = self.mc.shares_epoch
        self.adopt_plan(plan)
