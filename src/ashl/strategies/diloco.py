"""``diloco``: DiLoCo (Douillard et al. 2023) over Horovod. Every rank takes the same H local
steps with the user's optimizer (the inner one), then the ranks allreduce their deltas once,
in place (averaging.py), and every rank applies the same outer Nesterov step to the average:

    u = mean_i(params_i - global)          # minus the average pseudo-gradient
    m = b m + u;  global += lr (u + b m)   # torch.optim.SGD(nesterov=True) on -u

It is ``localsgd`` (a fixed plan: H for every rank, equal data shares, merge weight 1/n, no
profiling) with the outer optimizer ``nesterov(0.7, 0.9)``, DiLoCo's default; any
``outer_optimizer=`` of outer.py may replace it. Every rank keeps the same momentum (all see
the same allreduced sum), so no optimizer state travels. H: ``local_steps``, default 8, as
localsgd (DiLoCo's language models use hundreds; a round here is tens of milliseconds).

Synchronous, so fail-stop: a rank that dies ends the job, as with Horovod.
"""
from __future__ import annotations

from .localsgd import LocalSgdStrategy


class DilocoStrategy(LocalSgdStrategy):
    name = "diloco"
    default_outer = "nesterov(0.7, 0.9)"

    def plan_reason(self) -> str:
        return f"diloco: fixed plan, H={self.H}, outer {self.outer.spec} on the average"
