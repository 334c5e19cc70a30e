"""``bsp``: bulk-synchronous data parallelism, which IS ``hvd.DistributedOptimizer``.

``ashl.torch.DistributedOptimizer(opt, model=model, strategy="bsp")`` wraps the user's
optimizer with ``hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())``
(Horovod's backward hooks start one gradient allreduce per parameter during backward;
``step()`` synchronizes them, then takes the user's optimizer step on the averaged
gradients) and adds ashl's methods on top (optimizer.py, ``_wrap_horovod``). This strategy
only watches: it counts steps, emulates heterogeneity, evaluates and decides when to stop.

Every step is one commit (one synchronous gradient exchange).

Stopping together. Every ``control_every`` steps (default 1: it is a few floats), after the
local update, every rank adds its numbers to a small float64 ``hvd.allreduce_`` (Sum; each
slot has exactly one contributor, so all ranks read identical numbers):

    LOSS[r], HAS_LOSS[r]    rank r's running training loss
    ELAPSED                 rank 0's seconds since the strategy started (the run's clock)
    ACC, HAS_ACC            rank 0's evaluation of the model just updated (``evaluate``,
                            at most every ``eval_every_s``)
    PRESENT                 1 from every rank still training

and every rank feeds them, in the same order, to its own StageMachine (one stage, no
switch), so all ranks stop after the same step: target accuracy (the final model is the one
rank 0 evaluated), time budget, commit budget (steps * n), target loss. A rank that calls
``finish()`` early calls ``hvd.join()``: Horovod lets the others' allreduces complete
without it (zeros in its place), their next control round sees PRESENT < n, and they stop
on that step; ``finish()`` on every rank then meets in ``hvd.join()`` and ends with a
broadcast of rank 0's model (parameters and floating-point buffers: BatchNorm statistics
are not averaged by BSP).

Emulated heterogeneity (tests, benchmarks). Compute: the step is stretched after the local
update (StepClock). Link: ``link_departure(bytes of the gradients)`` sleeps in
``before_step()``, i.e. before step()'s ``synchronize()``, not inside backward where
Horovod has already handed the gradients to its background thread. The allreduce of THIS
step may therefore finish without waiting for the slow link, but the slow rank reaches its
next backward, and so submits the next step's gradients, that much later: in steady state
every step waits for the slowest rank's compute plus transfer, as on a real slow link; only
the first step differs.

``opt.stage`` reads "TRAIN" while training and "DONE" at the end.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Callable, Optional

import torch

from .. import kernels
from ..stages import Stage, StageConfig, StageMachine
from ..timeline import Timeline, timeline_path, write_chrome_trace
from .ashl import mpi_world
from .ashl_sync import _horovod
from .base import Strategy, loss_value

log = logging.getLogger("ashl")

_CONTROL_NAME = "ashl.bsp.control"
_FINAL_NAME = "ashl.bsp.final"


class BspStrategy(Strategy):
    name = "bsp"

    def __init__(self, model, params, *, sampler=None, comm=None,
                 stage_config: Optional[StageConfig] = None,
                 evaluate: Optional[Callable[[], float]] = None, eval_every_s: float = 2.0,
                 control_every: int = 1, heterogeneity=None, **ignored):
        # ignored: profile_steps, planner_config, drift_config (nothing to plan)
        MPI = mpi_world()
        comm = MPI.COMM_WORLD if comm is None else comm
        super().__init__(model, params, sampler=sampler, rank=comm.Get_rank(),
                         size=comm.Get_size(), heterogeneity=heterogeneity)
        self.hvd = _horovod()
        if self.hvd.size() != self.size or self.hvd.rank() != self.rank:
            raise RuntimeError(f"Horovod's world (rank {self.hvd.rank()} of {self.hvd.size()}) is "
                               f"not the communicator's (rank {self.rank} of {self.size}): "
                               "initialise with hvd.init(comm=MPI.COMM_WORLD)")
        if isinstance(control_every, bool) or not isinstance(control_every, int) or control_every < 1:
            raise ValueError(f"control_every must be an integer >= 1, got {control_every!r}")
        self.comm = comm.Dup()               # only for gathering the timeline at the end
        self.stage_config = dataclasses.replace(
            StageConfig() if stage_config is None else stage_config, switch=False)
        self.machine = StageMachine(self.size, self.stage_config, start_time=0.0)
        self.control_every = control_every
        self.evaluate, self.eval_every_s = evaluate, float(eval_every_s)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        n = self.size
        self._loss, self._has_loss = 0, n
        self._elapsed_i, self._acc, self._has_acc, self._present = 2 * n, 2 * n + 1, 2 * n + 2, 2 * n + 3
        self.ctl = torch.zeros(2 * n + 4, dtype=torch.float64)
        self.t0 = time.monotonic()
        self.started = False
        self.bytes_sent = 0
        self.eval_s = 0.0
        self.last_accuracy: Optional[float] = None
        self.stop_reason: Optional[str] = None
        self.left_early = False
        self._last_eval = float("-inf")
        self._steps_since_control = 0
        self._t_before = 0.0
        self._wall_step_end = time.time()
        self.timeline = Timeline(self.rank)

    @property
    def stage_label(self) -> str:
        return "DONE" if self.finished else "TRAIN"

    @property
    def horovod_optimizer(self) -> bool:
        """Is the optimizer being stepped Horovod's (its synchronize and step functions)?"""
        from horovod.torch.optimizer import _DistributedOptimizer as H
        cls = type(self.optimizer) if self.optimizer is not None else None
        return (cls is not None and cls.__dict__.get("synchronize") is H.synchronize
                and cls.__dict__.get("_ashl_step") is H.step)

    def set_epoch(self, epoch: int) -> None:
        pass

    # ---------------------------------------------------------------- driving
    def before_step(self) -> None:
        if self.finished:
            raise RuntimeError("this optimizer has finished (opt.finished is True); "
                               "stop the training loop")
        if not self.started:
            self.started = True
            self.stage = Stage.AHL       # "TRAIN" (the engine's one training stage)
            self.machine.begin_training(0.0, reason="bsp: training")
            self.clock.restart()
            self._wall_step_end = time.time()
        self._t_before = time.perf_counter()
        self._wall_before = time.time()
        self.link_departure(self.grad_bytes)

    def after_step(self, loss) -> None:
        t_update = time.perf_counter()
        # Link delay + synchronize + the update itself: communication, not compute.
        self.clock.exclude(t_update - self._t_before)
        self.step_done()
        self.local_steps += 1
        self.commits += 1
        self.bytes_sent += self.grad_bytes
        value = loss_value(loss)
        if value is not None and math.isfinite(value):
            self.loss.add(value)
        self._steps_since_control += 1
        t_ctl = time.perf_counter()
        if self._steps_since_control >= self.control_every:
            self._control()
        now_wall = time.time()
        self.timeline.span("compute", self._wall_step_end, self._wall_before, steps=1)
        self.timeline.span("commit", self._wall_before, now_wall, bytes=self.grad_bytes,
                           step=self.local_steps)
        self._wall_step_end = now_wall
        self.clock.exclude(time.perf_counter() - t_ctl)

    def _control(self, present: bool = True) -> None:
        """The tiny allreduce, then the same decisions on every rank."""
        steps, self._steps_since_control = self._steps_since_control, 0
        ctl = self.ctl
        ctl.zero_()
        loss = self.loss.commit()
        if loss is not None and math.isfinite(loss):
            ctl[self._loss + self.rank] = loss
            ctl[self._has_loss + self.rank] = 1.0
        if self.rank == 0:
            ctl[self._elapsed_i] = time.monotonic() - self.t0
            accuracy = self._maybe_evaluate()
            if accuracy is not None:
                ctl[self._acc] = accuracy
                ctl[self._has_acc] = 1.0
        ctl[self._present] = 1.0 if present else 0.0
        self.hvd.allreduce_(ctl, op=self.hvd.Sum, name=_CONTROL_NAME)
        self.bytes_sent += ctl.numel() * ctl.element_size()
        v = ctl.tolist()
        now = v[self._elapsed_i]
        m = self.machine
        for r in range(self.size):
            has = v[self._has_loss + r] > 0
            for _ in range(steps):
                m.commit(r, now, v[self._loss + r] if has else None)
        if v[self._has_acc] > 0:
            self.last_accuracy = v[self._acc]
            m.evaluation(now, accuracy=v[self._acc])
            self.timeline.instant("eval", accuracy=v[self._acc])
        present = int(round(v[self._present]))
        if present < self.size:
            m.stop(now, f"{self.size - present} rank(s) called finish() before the run ended")
        m.tick(now)
        if m.done:
            self.finished = True
            self.stage = Stage.DONE
            self.stop_reason = m.stop_reason
            self.timeline.instant("stop", reason=m.stop_reason)
            log.info("bsp: rank %d stops: %s", self.rank, self.stop_reason)

    def _maybe_evaluate(self) -> Optional[float]:
        """Rank 0: evaluate the model just updated (identical on every rank)."""
        if self.evaluate is None:
            return None
        now = time.monotonic()
        if now - self._last_eval < self.eval_every_s:
            return None
        self._last_eval = now
        t0 = time.perf_counter()
        accuracy = float(self.evaluate())
        self.eval_s += time.perf_counter() - t0
        return accuracy

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Collective: every rank meets in hvd.join() (a rank leaving early is seen by the
        others' next control round), then all take rank 0's model."""
        t0 = time.perf_counter()
        if not self.finished:
            self.left_early = True
        self.finished = True
        self.stage = Stage.DONE
        self.hvd.join()
        flat = torch.empty(self.numel, dtype=torch.float32, device=self.tensors[0].device)
        zeros = [torch.zeros_like(t) for t in self.tensors]
        kernels.pack_delta(self.tensors, zeros, flat)
        self.hvd.broadcast_(flat, root_rank=0, name=_FINAL_NAME)
        kernels.unpack_assign(self.tensors, zeros, flat)
        path = timeline_path()
        if path:
            traces = self.comm.gather(self.timeline.events, root=0)
            if self.rank == 0:
                write_chrome_trace(path, traces)
        self.comm.Barrier()
        self.comm.Free()
        self.clock.comm_s += time.perf_counter() - t0

    def save_checkpoint(self, path: str, optimizer) -> None:
        raise NotImplementedError("strategy 'bsp' does not checkpoint; save the model and "
                                  "optimizer state_dict as with plain Horovod")

    def load_checkpoint(self, path: str, optimizer) -> None:
        raise NotImplementedError("strategy 'bsp' does not checkpoint; load the model and "
                                  "optimizer state_dict as with plain Horovod")

    def counters(self) -> dict:
        c = super().counters()
        c.update(bytes_sent=self.bytes_sent, eval_s=self.eval_s, stop_reason=self.stop_reason,
                 last_accuracy=self.last_accuracy, left_early=self.left_early,
                 machine_commits=self.machine.commits,
                 horovod_optimizer=self.horovod_optimizer,
                 optimizer_class=[f"{k.__module__}.{k.__qualname__}"
                                  for k in type(self.optimizer).__mro__]
                 if self.optimizer is not None else None)
        return c
