"""The control numbers a synchronous round allreduces beside its data, and the decisions every
rank takes from them: the same numbers in, the same stage and stop out, on every rank, with no
extra message. Used by ``ashl-sync`` and ``localsgd`` (slots behind the model in the round's
one allreduce) and by ``bsp`` (a small allreduce of its own).

Slots (``ControlSlots.count`` floats):

    LOSS[r], HAS_LOSS[r]   rank r's running loss (RunningLoss.commit()) and a presence flag
    BUSY[r]                rank r's seconds of work since its previous exchange (the idle
                           estimate; not a decision input)
    ELAPSED[r], PLAN_T[r]  rank r's seconds since its strategy started / when its plan was
                           made; the run's clock is that of the lowest rank still training
                           (the control rank's, unless it left early)
    PRESENT[r]             1 from rank r while it trains (a rank that left early is in
                           ``hvd.join()``, which contributes zeros)
    ACC, HAS_ACC           the control rank's latest evaluation accuracy, new this round
    EPOCH_DONE             1 from every rank whose pass over its data has ended (the epoch
                           join of the averaging strategies)

Every slot has exactly one nonzero contributor, so its sum is exact whatever order the MPI
reduction adds in: all ranks read bit-identical numbers. ``decide`` feeds them, in the same
order on every rank, to that rank's own StageMachine.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..stages import Stage, StageMachine

__all__ = ["ControlSlots", "ControlReading", "decide", "idle_seconds", "last_decisions",
           "left_early_reason", "LEFT_EARLY"]


@dataclass(frozen=True)
class ControlReading:
    """What one allreduce of the control slots says, identical on every rank."""

    losses: tuple[Optional[float], ...]
    busy: tuple[float, ...]
    now: float
    plan_t: float
    accuracy: Optional[float]
    present: int
    epoch_done: int = 0


class ControlSlots:
    """The layout of the control slots of a `size`-rank run."""

    PER_RANK = 6        # LOSS, HAS_LOSS, BUSY, ELAPSED, PLAN_T, PRESENT

    def __init__(self, size: int):
        self.size = size
        self.count = self.PER_RANK * size + 3

    def encode(self, rank: int, *, loss: Optional[float], busy: float, control: bool,
               elapsed: float = 0.0, plan_t: float = 0.0, accuracy: Optional[float] = None,
               present: bool = True, epoch_done: bool = False) -> torch.Tensor:
        """This rank's contribution (float64; the accuracy only from the control rank)."""
        n, v = self.size, torch.zeros(self.count, dtype=torch.float64)
        if loss is not None and math.isfinite(loss):
            v[rank], v[n + rank] = loss, 1.0
        v[2 * n + rank] = busy
        v[3 * n + rank], v[4 * n + rank] = elapsed, plan_t
        v[5 * n + rank] = 1.0 if present else 0.0
        if control and accuracy is not None:
            v[6 * n], v[6 * n + 1] = accuracy, 1.0
        v[6 * n + 2] = 1.0 if epoch_done else 0.0
        return v

    def decode(self, summed: torch.Tensor) -> ControlReading:
        n, v = self.size, summed.to(torch.float64).tolist()
        present = [r for r in range(n) if v[5 * n + r] > 0]
        clock = present[0] if present else 0
        return ControlReading(
            losses=tuple(v[r] if v[n + r] > 0 else None for r in range(n)),
            busy=tuple(v[2 * n:3 * n]), now=v[3 * n + clock], plan_t=v[4 * n + clock],
            accuracy=v[6 * n] if v[6 * n + 1] > 0 else None,
            present=len(present), epoch_done=int(round(v[6 * n + 2])))


def decide(machine: StageMachine, reading: ControlReading, commits_per_rank: int = 1,
           training_reason: str = "profiling finished, plan ready") -> Stage:
    """The same decisions on every rank: training starts at the plan's time, every rank's
    commits count (commit budgets are rounds x size), an accuracy is an evaluation, a rank
    that left stops the run, and the clock checks the time budgets."""
    now = reading.now
    if machine.transitions:   # the clock's rank changed (rank 0 left): it may lag a little
        now = max(now, machine.start_time + machine.transitions[-1].at_s)
    if machine.stage is Stage.PROFILE:
        machine.begin_training(reading.plan_t, reason=training_reason)
    for rank, loss in enumerate(reading.losses):
        for _ in range(commits_per_rank):
            machine.commit(rank, now, loss)
    if reading.accuracy is not None:
        machine.evaluation(now, accuracy=reading.accuracy)
    gone = machine.n_ranks - reading.present
    if gone > 0:
        machine.stop(now, f"{gone} rank(s) called finish() before the run ended")
    machine.tick(now)
    return machine.stage


def idle_seconds(busy: Sequence[float], rank: int) -> float:
    """How long `rank` waited in the allreduce for the busiest rank (an estimate)."""
    return max(0.0, max(busy) - busy[rank])


LEFT_EARLY = "finish() was called before the run ended"   # a leaving rank's own stop


def left_early_reason(ranks: Sequence[int], size: int) -> str:
    """Why the run stopped when `ranks` called ``finish()`` before it ended, and nothing
    else stopped it: at a Horovod script's end, every rank."""
    if len(ranks) == size:
        return "every rank called finish() before the run ended"
    return f"rank(s) {', '.join(map(str, ranks))} called finish() before the run ended"


def last_decisions(comm, machine: StageMachine) -> StageMachine:
    """Collective, once every rank has joined at the end: for every rank, the stage machine
    of the rank that saw the most rounds (one stopped by a round's decision before one that
    left, then the lowest rank). A rank that left early missed the rounds the others took
    without it (in ``hvd.join()``); with this every rank reports the same stages,
    transitions and stop, and a stop by leaving names every rank that left then."""
    machines = comm.allgather(machine)
    left = [m.stop_reason == LEFT_EARLY for m in machines]
    most = max(range(len(machines)), key=lambda r: (machines[r].commits, not left[r], -r))
    chosen = copy.deepcopy(machines[most])
    if left[most]:
        chosen.restate_stop(left_early_reason(
            [r for r, m in enumerate(machines) if left[r] and m.commits == chosen.commits],
            len(machines)))
    return chosen
