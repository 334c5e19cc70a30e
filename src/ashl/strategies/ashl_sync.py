"""ASHL without a server: the same per-rank H_i and data shares, but every round ends in ONE
in-place ``hvd.allreduce_`` of share-weighted deltas. For clusters where a central
parameter server would be the bottleneck.

A round on rank i: H_i local steps (``plan.local_steps(i, stage)``), then

    flat[:numel] = w_i * (params - anchors)          # kernels.pack_delta, one fused pass
    flat[numel:] = this rank's control slots          # see below
    hvd.allreduce_(flat, op=hvd.Sum)                  # the only message of the round
    anchors += flat[:numel]; params = anchors         # kernels.unpack_add, one fused pass

so every rank ends the round holding the same model ``anchor + sum_i w_i delta_i`` (w_i: the
plan's merge weights of the stage). Because the plan gives every rank a round of the same
wall time, nobody waits long at the allreduce.

Control slots and the stage machine. There is no coordinator at run time: every rank owns a
``StageMachine`` (same ``StageConfig``) and feeds it, after each allreduce, the *same*
numbers, read from the slots behind the model:

    LOSS[r], HAS_LOSS[r]   rank r's running loss (RunningLoss.commit()) and a presence flag
    BUSY[r]                rank r's seconds from the end of the previous allreduce to the
                           start of this one (for the idle estimate; not a decision input)
    ELAPSED, PLAN_T        rank 0's seconds since this strategy started / when the plan was made
    ACC, HAS_ACC           rank 0's latest evaluation accuracy (``evaluate``), new this round
    LEAVE                  number of ranks that called ``finish()`` before the run ended

Every slot has exactly one nonzero contributor, so its sum is exact whatever order the MPI
reduction adds in: all ranks read bit-identical control numbers (the losses are sent one per
rank rather than pre-weighted, for that reason; the machine applies the stage's shares D_i
itself through ``set_weights``, so its global loss is the usual G = sum_i D_i L_i). Each rank
then calls, in the same order, ``begin_training(plan time)`` (first round), ``commit(r, now,
L_r)`` for every rank r (so commit budgets count rounds * size), ``evaluation(now, accuracy)``
when rank 0 sent one, ``tick(now)`` -- with ``now`` = rank 0's clock -- and therefore takes the
same AHL -> SHL switch (global loss < switch_loss, or the AHL budget) and the same stop (target
loss/accuracy, time budget on rank 0's clock, commit budget) on the same round, with no
extra message.

Differences from strategy "ashl":
  * SHL is dense: SHL uses the SHL stage's H_i (k_SHL), shares and merge weights, but no top-k
    compression and no staleness bound (a synchronous round has no staleness).
  * No re-planning: ``drift_config`` is accepted (and handed to the profiling coordinator) but
    ignored; the first plan holds for the whole run.
  * The profiling round (``profile_steps`` equal steps on equal shares) is merged with
    uniform weights 1/size, because every rank did the same work in it.
  * Evaluation runs on rank 0 right after a round's merge (on the global model); its result
    travels in the next round's slots. If the run stops on a round that carried an accuracy
    meeting ``target_accuracy``, every rank keeps the evaluated model (that round's deltas
    are dropped), so the model a user ends with is the one that met the target.
  * A merged delta with NaN/Inf is dropped on every rank (all see the same sum), counted in
    ``rejected``.

Early ``finish()``: a rank that leaves before the run has ended does one last round with its
(partial) delta and LEAVE=1; the other ranks meet it at their own end-of-round allreduce and
all stop on that round. Stop decisions are only ever taken from allreduced numbers, so no
rank can be left waiting in an allreduce nobody else joins. ``finish()`` then broadcasts
rank 0's model (ranks already hold the same model; this removes any last-bit difference an
MPI reduction might leave) and ends with the coordinator's barrier.

Horovod must be initialised by the user on the same world: ``hvd.init(comm=MPI.COMM_WORLD)``.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional

import torch

from .. import kernels
from ..coordinator import DriftConfig, MPICoordinator
from ..planner import Plan, PlannerConfig
from ..stages import Stage, StageConfig, StageMachine
from ..timeline import Timeline, timeline_path, write_chrome_trace
from .ashl import mpi_world
from .base import RoundStrategy, verify_same_model

log = logging.getLogger("ashl")

_ALLREDUCE_NAME = "ashl_sync.round"
_FINAL_NAME = "ashl_sync.final"


def _horovod():
    try:
        import horovod.torch as hvd
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("strategy 'ashl-sync' needs horovod.torch (pip install ashl[mpi])") from exc
    if not hvd.is_initialized():
        raise RuntimeError("strategy 'ashl-sync' averages with Horovod: call "
                           "hvd.init(comm=MPI.COMM_WORLD) before creating the optimizer")
    return hvd


class _Slots:
    """Offsets of the control slots behind the model in the flat buffer."""

    def __init__(self, numel: int, size: int):
        self.loss = numel
        self.has_loss = numel + size
        self.busy = numel + 2 * size
        base = numel + 3 * size
        self.elapsed, self.plan_t, self.acc, self.has_acc, self.leave = range(base, base + 5)
        self.end = base + 5

    @property
    def count(self) -> int:
        return self.end - self.loss


class AshlSyncStrategy(RoundStrategy):
    name = "ashl-sync"

    def __init__(self, model, params, *, sampler=None, comm=None, compression=None,
                 profile_steps: int = 10,
                 planner_config: Optional[PlannerConfig] = None,
                 stage_config: Optional[StageConfig] = None,
                 drift_config: Optional[DriftConfig] = None,
                 evaluate: Optional[Callable[[], float]] = None, eval_every_s: float = 2.0,
                 heterogeneity=None):
        MPI = mpi_world()
        comm = MPI.COMM_WORLD if comm is None else comm
        super().__init__(model, params, sampler=sampler, rank=comm.Get_rank(),
                         size=comm.Get_size(), heterogeneity=heterogeneity)
        verify_same_model(comm, self.names, self.tensors)
        self.hvd = _horovod()
        if self.hvd.size() != self.size or self.hvd.rank() != self.rank:
            raise RuntimeError(f"Horovod's world (rank {self.hvd.rank()} of {self.hvd.size()}) is "
                               f"not the communicator's (rank {self.rank} of {self.size}): "
                               "initialise with hvd.init(comm=MPI.COMM_WORLD)")
        if compression is not None and getattr(compression, "ratio", 1.0) < 1.0:
            raise ValueError("strategy 'ashl-sync' sends dense fp32 deltas; compression is only "
                             "available with strategy 'ashl'")
        if profile_steps < 3:
            raise ValueError(f"profile_steps must be >= 3 (one is warm-up), got {profile_steps}")
        if not (isinstance(eval_every_s, (int, float)) and eval_every_s >= 0):
            raise ValueError(f"eval_every_s must be a number >= 0, got {eval_every_s!r}")
        self.t0 = time.monotonic()           # rank 0's copy is the run's clock
        self.mc = MPICoordinator(comm, root=0, planner_config=planner_config,
                                 stage_config=stage_config, drift_config=drift_config)
        self.stage_config = StageConfig() if stage_config is None else stage_config
        self.machine = StageMachine(self.size, self.stage_config, start_time=0.0)
        self.profile_steps = profile_steps
        self.evaluate, self.eval_every_s = evaluate, float(eval_every_s)
        self.slots = _Slots(self.numel, self.size)
        self.flat = torch.zeros(self.slots.end, dtype=torch.float32,
                                device=self.tensors[0].device)
        self.anchors: Optional[list[torch.Tensor]] = None
        self.plan_t: Optional[float] = None  # seconds since t0 when the plan was made
        self.pending_accuracy: Optional[float] = None   # rank 0: evaluated, not yet sent
        self.last_accuracy: Optional[float] = None
        self.stop_reason: Optional[str] = None
        self.rejected = 0
        self.left_early = False
        self.bytes_allreduced = 0
        self.idle_s = 0.0
        self.eval_s = 0.0
        self._last_eval = float("-inf")
        self._round_start = time.perf_counter()   # for the busy slot (perf_counter)
        self._round_wall = time.time()            # for the timeline (wall clock)
        # Chrome-trace spans "compute" (local steps of a round) and "commit" (pack, the
        # allreduce with any wait in it, merge), instants "plan", "stage", "eval", "stop";
        # written at finish() when ASHL_TIMELINE is set, as strategy "ashl" does.
        self.timeline = Timeline(self.rank)

    # ---------------------------------------------------------------- helpers
    def local_steps_target(self) -> int:
        if self.stage == Stage.PROFILE:
            return self.profile_steps
        return self.plan.local_steps(self.rank, self.stage.value)

    def merge_weight(self, stage: Stage) -> float:
        if stage == Stage.PROFILE:
            return 1.0 / self.size
        return float(self.plan.stage(stage.value).merge_weights[self.rank])

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    @property
    def events(self) -> list[dict]:
        """This rank's timeline events (Chrome-trace dicts)."""
        return self.timeline.events

    @property
    def transitions(self) -> list[dict]:
        """The stage machine's transitions (identical on every rank)."""
        return [{"at_s": t.at_s, "commits": t.commits, "from": t.from_stage.value,
                 "to": t.to_stage.value, "reason": t.reason} for t in self.machine.transitions]

    # ---------------------------------------------------------------- driving
    def before_step(self) -> None:
        if self.anchors is None:
            # The model as broadcast before training: the anchor of the first delta.
            self.anchors = [t.detach().clone() for t in self.tensors]
            self._round_wall = time.time()
            self.clock.restart()

    def _end_round(self) -> None:
        self._round()

    def _make_plan(self) -> None:
        """Collective: measure the link with the dense payload, plan on rank 0, broadcast."""
        push, pull = self.mc.measure_link(4 * self.numel)
        emulated = self.hetero.link_delay(4 * self.numel)
        self.profiler.extend("push", [push.mean + emulated])
        self.profiler.extend("pull", [pull.mean + emulated])
        profile = self.profiler.profile(min_warmup=1)
        plan = self.mc.establish_plan(profile, serve_reports=False)
        self.plan_t = self._elapsed()
        # self.stage stays PROFILE for the round that ends now (the profiling steps, merged
        # with uniform weights); the machines enter AHL when that round's numbers arrive.
        self._apply_plan(plan, Stage.AHL)
        self.timeline.instant("plan", version=plan.version,
                              H=plan.local_steps(self.rank, Stage.AHL.value))
        self._round_start = time.perf_counter()   # profiling collectives are not round work

    def _apply_plan(self, plan: Plan, stage: Stage) -> None:
        self.plan = plan
        shares = plan.stage(stage.value).shares
        self.machine.set_weights(shares)
        if self.sampler is not None and hasattr(self.sampler, "set_shares"):
            self.sampler.set_shares(list(shares))

    def _round(self, leave: bool = False) -> None:
        """End this rank's round: one allreduce, then the same decisions on every rank."""
        s, flat = self.slots, self.flat
        stage = self.stage
        t_start = time.perf_counter()
        wall_start = time.time()
        busy = t_start - self._round_start
        kernels.pack_delta(self.tensors, self.anchors, flat[:self.numel],
                           scale=self.merge_weight(stage))
        ctl = torch.zeros(s.count, dtype=torch.float64)
        off = lambda i: i - self.numel  # noqa: E731 - slot index within ctl
        loss = self.loss.commit()
        if loss is not None and math.isfinite(loss):
            ctl[off(s.loss) + self.rank] = loss
            ctl[off(s.has_loss) + self.rank] = 1.0
        ctl[off(s.busy) + self.rank] = busy
        if self.rank == 0:
            ctl[off(s.elapsed)] = self._elapsed()
            ctl[off(s.plan_t)] = self.plan_t
            if self.pending_accuracy is not None:
                ctl[off(s.acc)] = self.pending_accuracy
                ctl[off(s.has_acc)] = 1.0
                self.pending_accuracy = None
        if leave:
            ctl[off(s.leave)] = 1.0
        flat[self.numel:].copy_(ctl)

        t_send = time.perf_counter()
        # An emulated slow link delays this rank's contribution; the allreduce then ends
        # no sooner than the slowest rank's data arrives, as on a real network.
        self.link_departure(4 * flat.numel())
        self.hvd.allreduce_(flat, op=self.hvd.Sum, name=_ALLREDUCE_NAME)
        t_done = time.perf_counter()
        self.bytes_allreduced += 4 * flat.numel()
        self.commits += 1
        steps = self.round_steps
        self.round_steps = 0
        self.clock.new_round()

        # The decisions: from allreduced numbers only, in the same order on every rank.
        ctl = flat[self.numel:].to(torch.float64).tolist()
        losses = ctl[off(s.loss):off(s.loss) + self.size]
        has_loss = ctl[off(s.has_loss):off(s.has_loss) + self.size]
        busies = ctl[off(s.busy):off(s.busy) + self.size]
        now = ctl[off(s.elapsed)]
        accuracy = ctl[off(s.acc)] if ctl[off(s.has_acc)] > 0 else None
        leavers = int(round(ctl[off(s.leave)]))
        m = self.machine
        if m.stage is Stage.PROFILE:
            m.begin_training(ctl[off(s.plan_t)])
        for r in range(self.size):
            m.commit(r, now, losses[r] if has_loss[r] > 0 else None)
        if accuracy is not None:
            self.last_accuracy = accuracy
            m.evaluation(now, accuracy=accuracy)
        if leavers:
            m.stop(now, f"{leavers} rank(s) called finish() before the run ended")
        m.tick(now)

        # The merge (or, when the run ends on an accuracy measured on the anchor, no merge).
        keep_evaluated = (m.done and accuracy is not None
                          and self.stage_config.target_accuracy is not None
                          and accuracy >= self.stage_config.target_accuracy)
        finite = bool(torch.isfinite(flat[:self.numel]).all())
        if keep_evaluated or not finite:
            if not finite:
                self.rejected += 1
                log.warning("ashl-sync: round %d merged a non-finite delta; every rank drops it",
                            self.commits)
            flat[:self.numel].zero_()
        kernels.unpack_add(self.tensors, self.anchors, flat[:self.numel])

        self.idle_s += max(0.0, max(busies) - busies[self.rank])
        wall_end = time.time()
        self.timeline.span("compute", self._round_wall, wall_start, steps=steps)
        self.timeline.span("commit", wall_start, wall_end, stage=stage.value, round=self.commits,
                           bytes=4 * flat.numel(), allreduce_s=t_done - t_send,
                           accepted=finite and not keep_evaluated)
        if accuracy is not None:
            self.timeline.instant("eval", accuracy=accuracy)
        self._follow_machine()
        if self.rank == 0:
            self._maybe_evaluate()
        self._round_start = time.perf_counter()
        self._round_wall = time.time()

    def _follow_machine(self) -> None:
        new = self.machine.stage
        if new == self.stage:
            return
        self.timeline.instant("stop" if new is Stage.DONE else "stage", stage=new.value,
                              reason=self.machine.transitions[-1].reason)
        if new is Stage.DONE:
            self.stage = Stage.DONE
            self.finished = True
            self.stop_reason = self.machine.stop_reason
            log.info("ashl-sync: rank %d stops: %s", self.rank, self.stop_reason)
        else:
            self.stage = new
            self._apply_plan(self.plan, new)

    def _maybe_evaluate(self) -> None:
        """Rank 0: evaluate the global model just merged; the result goes out next round."""
        if self.evaluate is None or self.finished:
            return
        now = time.monotonic()
        if now - self._last_eval < self.eval_every_s:
            return
        self._last_eval = now
        t0 = time.perf_counter()
        self.pending_accuracy = float(self.evaluate())
        dt = time.perf_counter() - t0
        self.eval_s += dt
        self.clock.last_end += dt    # neither compute nor communication

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Leave the run (collective). If the run has not ended, one last round tells every
        rank to stop on it; then all ranks take rank 0's model and meet at a barrier."""
        if self.anchors is None:
            self.before_step()
        t0 = time.perf_counter()
        if self.plan is None:
            # Stopped before profiling finished: plan now so the collective calls line up.
            if not self.profiler.samples["compute"]:
                self.profiler.record("compute", 1e-3)
            self._make_plan()
        if not self.finished:
            self.left_early = True
            self._round(leave=True)
        self.finished = True
        self.stage = Stage.DONE
        final = self.flat[:self.numel]
        kernels.pack_delta(self.anchors, [torch.zeros_like(a) for a in self.anchors], final)
        self.hvd.broadcast_(final, root_rank=0, name=_FINAL_NAME)
        kernels.unpack_assign(self.tensors, self.anchors, final)
        path = timeline_path()
        if path:
            traces = self.mc.comm.gather(self.timeline.events, root=0)
            if self.rank == 0:
                write_chrome_trace(path, traces)
        self.mc.close()
        self.clock.comm_s += time.perf_counter() - t0

    def save_checkpoint(self, path: str, optimizer) -> None:
        raise NotImplementedError("strategy 'ashl-sync' does not checkpoint yet; use strategy 'ashl'")

    def load_checkpoint(self, path: str, optimizer) -> None:
        raise NotImplementedError("strategy 'ashl-sync' does not checkpoint yet; use strategy 'ashl'")

    def counters(self) -> dict:
        c = super().counters()
        c.update(rounds=self.commits, bytes_allreduced=self.bytes_allreduced,
                 bytes_sent=self.bytes_allreduced,
                 idle_s=self.idle_s, eval_s=self.eval_s, rejected=self.rejected,
                 machine_commits=self.machine.commits, stop_reason=self.stop_reason,
                 last_accuracy=self.last_accuracy, left_early=self.left_early)
        return c
