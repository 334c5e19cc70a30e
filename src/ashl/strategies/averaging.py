"""Synchronous model averaging over Horovod: ``ashl-sync`` and ``localsgd``.

A round on rank i: H_i local steps (the plan's), then

    flat[:numel] = w_i * (params - anchors)          # kernels.pack_delta, one fused pass
    flat[numel:] = this rank's control slots          # control.py
    hvd.allreduce_(flat, op=hvd.Sum)                  # the only message of the round
    anchors += flat[:numel]; params = anchors         # kernels.unpack_add, one fused pass

so every rank ends the round holding the same model ``anchor + sum_i w_i delta_i`` (w_i: the
plan's merge weights of the stage). With an outer optimizer (``outer_optimizer=``, outer.py;
``diloco``'s Nesterov) every rank applies the same outer step to that sum instead, from the
same momentum, so the ranks stay equal. There is no coordinator at run time: every rank owns a
StageMachine and feeds it the same allreduced control numbers (``control.decide``), so all
ranks switch AHL -> SHL and stop on the same round. The control rank (0) evaluates the
merged model after a round; the accuracy travels in the next round's slots, and if the run
stops on it every rank keeps the evaluated model (that round's deltas are dropped), so the
model a user ends with is the one that met the target. A merged delta with NaN/Inf is dropped
on every rank (all see the same sum), counted in ``rejected``.

The epoch loop: ranks with their own H_i and data shares do different numbers of rounds per
epoch, and a script's own collectives between epochs (``hvd.allreduce`` of its test metrics)
would meet a round's allreduce on another rank and deadlock. So when a rank's
HeterogeneousSampler has handed out its pass (``on_exhausted``), the rank exchanges its
partial round and then joins the others' rounds with an empty delta and EPOCH_DONE=1 until
every rank's pass has ended: all leave the epoch at the same allreduce. Its rounds then wait
for its next pass; the batches still in its loader count into that pass's first round.

A rank that calls ``finish()`` before the run has ended joins (``hvd.join()``), as bsp's
does: while it waits there, Horovod completes the others' allreduces with zeros in its place,
their rounds read PRESENT < n and every one of them stops on the same round. The others may
as well be waiting in a collective of the script's own (an epoch's metrics, which a rank that
broke out of its loop skipped): the join completes that one too, so no rank waits for ever.
Once every rank has joined, one last allreduce merges what each rank trained since its last
round (the leaving rank's partial round; zeros from the others), the rank that left takes
the others' stage history (it missed their last round), and rank 0's model is broadcast
(ranks hold the same model already; this removes any last-bit difference a reduction might
leave).

Horovod must be initialised by the user on the same world: ``hvd.init(comm=MPI.COMM_WORLD)``.
A subclass supplies the plan and the merge weight.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from .. import checkpoint, kernels
from ..compression import Payload, check_compression
from ..coordinator import DriftConfig, MPICoordinator
from ..outer import PlainMerge, make_outer
from ..planner import PlannerConfig
from ..stages import Stage, StageConfig, StageMachine
from .base import Strategy, restored_if_refused
from .control import LEFT_EARLY, ControlSlots, decide, idle_seconds, last_decisions
from .model_state import verify_same_model
from .join import horovod_join
from .runtime import horovod, horovod_staging, world_comm

log = logging.getLogger("ashl")

_ALLREDUCE_NAME = "ashl.averaging.round"
_FINAL_NAME = "ashl.averaging.final"


class ModelAveragingStrategy(Strategy):
    """Rounds that end in one allreduce of weighted deltas and the control slots."""

    accepts_compression = ("none",)
    default_outer = "none"          # outer_optimizer=None: this (outer.py)
    _resumed = None                 # what _check_run_record read of a loaded checkpoint

    def __init__(self, model, params, *, sampler=None, comm=None, compression=None,
                 outer_optimizer: Optional[str] = None,
                 planner_config: Optional[PlannerConfig] = None,
                 stage_config: Optional[StageConfig] = None,
                 drift_config: Optional[DriftConfig] = None,
                 evaluate=None, eval_every_s: float = 2.0, heterogeneity=None, hvd=None,
                 profile_steps: int = 10):
        world = world_comm(comm)
        super().__init__(model, params, comm=world, sampler=sampler, heterogeneity=heterogeneity,
                         evaluate=evaluate, eval_every_s=eval_every_s, control_rank=0,
                         stage_config=stage_config, profile_steps=profile_steps)
        check_compression(compression, self.name, self.accepts_compression)
        verify_same_model(world, self.names, self.tensors)
        self.hvd = horovod(self.name, world) if hvd is None else hvd
        # Horovod without GPU operations: a CUDA model's allreduce goes through host memory
        self.staging = horovod_staging(self.hvd, self.device, self.name)
        self.t0 = time.monotonic()     # the lowest training rank's copy is the run's clock
        self.mc = MPICoordinator(world, root=0, planner_config=planner_config,
                                 stage_config=stage_config, drift_config=drift_config)
        self._machine = StageMachine(self.size, self.stage_config, start_time=0.0)
        self.slots = ControlSlots(self.size)
        self.flat = torch.zeros(self.numel + self.slots.count, dtype=torch.float32,
                                device=self.tensors[0].device)
        # delayed-nesterov's n defaults to 1: a round is one merged update
        self.outer = make_outer(self.default_outer if outer_optimizer is None else outer_optimizer,
                                self.numel, round_updates=1, device=self.flat.device,
                                params_numel=self.params_numel)
        self.outer_update = None if isinstance(self.outer, PlainMerge) else torch.empty_like(
            self.flat[:self.numel])
        self.anchors: Optional[list[torch.Tensor]] = None
        self.plan_t = 0.0                    # seconds since t0 when the plan was made
        self.idle_s = 0.0
        self._round_start = time.perf_counter()   # for the busy slot
        self._between_passes = False          # this rank's pass ended: no round until the next
        self.join_rounds = 0                  # rounds of epoch joins (the first one partial)
        self._leaving_weight = 0.0            # the merge weight of a partial round at finish()
        self._kept_evaluated = False          # the run stopped on the model it evaluated
        if hasattr(sampler, "on_exhausted"):
            sampler.on_exhausted(self._end_of_pass)
            sampler.on_iteration(self._begin_pass)

    # ---------------------------------------------------------------- what differs
    def merge_weight(self, stage: Stage) -> float:
        raise NotImplementedError

    def machine(self) -> StageMachine:
        return self._machine

    def adopt_plan(self, plan) -> None:
        super().adopt_plan(plan)
        self._round_start = time.perf_counter()   # profiling collectives are not round work

    def _give_shares(self) -> None:
        """The sampler's shares and the global loss's weights D_i move together."""
        super()._give_shares()
        self._machine.set_weights(self.plan.stage(self.stage.planned).shares)

    # ----------------------------------------------------------------------- the round
    def _start(self) -> None:
        self.check_every_rank_resumes()
        self.anchors = kernels.clone_tensors(self.tensors)

    def _round_done(self) -> bool:
        return not self._between_passes and super()._round_done()

    def _begin_pass(self) -> None:
        self._between_passes = False

    def _end_of_pass(self) -> None:
        """The epoch join (module docstring): this rank's pass is over; exchange what it has
        and meet the others' rounds until every rank's pass is over too."""
        if not self.started or not self.planned or self.finished:
            return      # (a pass ending before the plan has ended the first round first)
        self._between_passes = True
        t0 = time.time()
        while not self.finished:
            self.join_rounds += 1
            if self._exchange(epoch_done=True).epoch_done == self.size:
                break
        self.timeline.span("epoch join", t0, time.time())
        self.clock.restart()     # the wait is not the next step's compute

    def _exchange(self, final: bool = False, epoch_done: bool = False):
        """End this rank's round: one allreduce, then the same decisions on every rank;
        returns what the control slots said."""
        if final:        # a leaving rank joins instead (_final_model); its partial round
            self._leaving_weight = self.merge_weight(self.stage)   # is merged after that
            self._machine.stop(time.monotonic() - self.t0, LEFT_EARLY)
            return None
        start, stage, steps = time.time(), self.stage, self.round_steps
        delta, control = self.flat[:self.numel], self.flat[self.numel:]
        busy = time.perf_counter() - self._round_start
        kernels.pack_delta(self.tensors, self.anchors, delta, scale=self.merge_weight(stage))
        control.copy_(self.slots.encode(
            self.rank, loss=self.loss.commit(), busy=busy, control=self.rank == 0,
            elapsed=time.monotonic() - self.t0, plan_t=self.plan_t,
            # the control rank's evaluation of the anchors, started after the last round
            accuracy=self.evaluations.take(wait=True) if self.rank == 0 else None,
            epoch_done=epoch_done))
        # An emulated slow link delays this rank's contribution; the allreduce then ends no
        # sooner than the slowest rank's data arrives, as on a real network.
        self.hetero.depart(4 * self.flat.numel())
        control = self._allreduce()
        self.bytes_sent += 4 * self.flat.numel()
        self.commits += 1
        self.round_steps = 0
        self.clock.new_round()
        reading = self.slots.decode(control)
        decide(self._machine, reading)
        merged = self._merge(reading)
        self.idle_s += idle_seconds(reading.busy, self.rank)
        self.round_span(start, steps=steps, stage=stage.value, round=self.commits,
                        bytes=4 * self.flat.numel(), accepted=merged)
        if reading.accuracy is not None:
            self.timeline.instant("eval", accuracy=reading.accuracy)
        self._follow_machine(self._machine)
        if self.rank == 0 and not self.finished:
            self.evaluations.start()     # of params = anchors, which hold until the next merge
        self._round_start = time.perf_counter()
        return reading

    def _allreduce(self) -> torch.Tensor:
        """self.flat summed over the ranks, in place; returns its control slots, in host
        memory when the sum was staged there."""
        summed = self.staging.to_host_flat(self.flat, "allreduce")
        self.hvd.allreduce_(summed, op=self.hvd.Sum, name=_ALLREDUCE_NAME)
        self.staging.from_host(self.flat, summed)
        return summed[self.numel:]

    def _merge(self, reading) -> bool:
        """anchors += the summed deltas; params = anchors. Not when the run stops on an
        accuracy measured on the anchors (keep the model that met the target), nor when the
        sum holds NaN/Inf (every rank drops it)."""
        target = self.stage_config.target_accuracy
        self._kept_evaluated = (self._machine.done and reading.accuracy is not None
                                and target is not None and reading.accuracy >= target)
        return self._apply(self.flat[:self.numel], keep=self._kept_evaluated)

    def _apply(self, delta: torch.Tensor, keep: bool = False) -> bool:
        """anchors += `delta` (through the outer optimizer, if any); params = anchors. With
        `keep`, or when `delta` holds NaN/Inf, params = anchors unchanged. Whether it merged."""
        finite = bool(torch.isfinite(delta).all())
        if not finite:
            self.rejected += 1
            log.warning("%s: round %d merged a non-finite delta; every rank drops it",
                        self.name, self.commits)
        if keep or not finite:
            delta.zero_()
        elif self.outer_update is not None and bool(delta.any()):
            # the outer step, as a change of the anchors; a round in which nobody moved (an
            # epoch join's empty rounds) takes none, so the momentum does not run on alone
            self.outer.step(self.outer_update.zero_(), Payload.dense(delta), 1.0)
            delta = self.outer_update
        elif self.outer_update is None:
            self.outer.updates += 1              # the plain merge is unpack_add itself
        kernels.unpack_add(self.tensors, self.anchors, delta)
        return finite and not keep

    # ------------------------------------------------------------------------- the end
    def _final_model(self) -> None:
        """Collective, in finish(): meet every rank in hvd.join() (module docstring), merge
        the partial rounds, then every rank takes rank 0's model."""
        horovod_join(self.hvd, self.staging)
        self._machine = last_decisions(self.comm, self._machine)
        self._final_round()
        final = self.flat[:self.numel]
        kernels.pack_delta(self.anchors, [torch.zeros_like(a) for a in self.anchors], final)
        sent = self.staging.to_host_flat(final, "final")
        self.hvd.broadcast_(sent, root_rank=0, name=_FINAL_NAME)
        kernels.unpack_assign(self.tensors, self.anchors, self.staging.to_device(sent, "final"))

    def _final_round(self) -> None:
        """What each rank trained since its last round (a rank that left early: its partial
        round; one the run stopped: nothing), summed and added to the anchors as it is: no
        outer step (a round's momentum must not fire again on a few leftover steps), not
        when the run keeps the model that met the target, not when the sum holds NaN/Inf."""
        self.flat.zero_()
        delta = self.flat[:self.numel]
        kernels.pack_delta(self.tensors, self.anchors, delta, scale=self._leaving_weight)
        self._allreduce()
        if self._kept_evaluated or not bool(delta.any()):
            return
        if not bool(torch.isfinite(delta).all()):
            log.warning("%s: the last partial round summed to NaN/Inf; every rank drops it",
                        self.name)
            return
        kernels.unpack_add(self.tensors, self.anchors, delta)

    def _close(self) -> None:
        self.mc.close()

    # --------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str, optimizer) -> None:
        """Not collective; call it on every rank at the same point of the loop (after an
        epoch, where the epoch join has lined them up): rank 0 writes the last merged model,
        the outer optimizer's state (diloco's momentum) and what the strategy adds (ashl-sync:
        its plan and stage) to ``path``, every rank its optimizer state and counters to
        ``path.rank<r>``. Progress since the last round is not saved."""
        if self.anchors is None:
            raise RuntimeError("nothing to checkpoint before the first step()")
        record = self._run_record()     # on every rank: one that cannot save raises on all
        if self.rank == 0:
            outer = {k: v.cpu() if isinstance(v, torch.Tensor) else v
                     for k, v in self.outer.state_dict().items()}
            checkpoint.atomic_save({"format": checkpoint.FORMAT, "strategy": self.name,
                                    "size": self.size, "numel": self.numel,
                                    "global_model": self.flat_model(self.anchors).cpu(),
                                    "outer": outer, **record}, path)
        self._save_own(path, optimizer)

    def load_checkpoint(self, path: str, optimizer) -> None:
        """Before the first step, on every rank: continue from ``path``. The budgets
        (max_seconds, max_commits) count from the resume."""
        if self.started:
            raise RuntimeError("load_checkpoint must be called before the first step()")
        run = checkpoint.load(path)
        checkpoint.check_run(run, path, self.name, self.size, self.numel)
        resumed = self._check_run_record(run, path)
        with restored_if_refused(self.outer):
            self.outer.load_state_dict(run["outer"])     # every rank: the same momentum
            self._load_own(path, optimizer)
        kernels.unpack_assign(self.tensors, [t.clone() for t in self.tensors],
                              run["global_model"].to(self.flat.device))
        self._resumed = resumed

    def _run_record(self) -> dict:
        """What the strategy adds to the run's checkpoint file."""
        return {}

    def _check_run_record(self, run: dict, path: str):
        """Read back what _run_record saved, or refuse the file (before anything loads);
        kept as ``self._resumed`` once the whole checkpoint has loaded."""
        return None

    def counters(self) -> dict:
        c = super().counters()
        c.update(rounds=self.commits, idle_s=self.idle_s, join_rounds=self.join_rounds,
                 outer={"spec": str(self.outer.spec), "updates": self.outer.updates})
        return c
