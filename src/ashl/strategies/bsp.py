"""``bsp``: bulk-synchronous data parallelism, which IS ``hvd.DistributedOptimizer``.

``ashl.torch.DistributedOptimizer(opt, model=model, strategy="bsp")`` wraps the user's
optimizer with ``hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())``
(Horovod's backward hooks start one gradient allreduce per parameter during backward;
``step()`` synchronizes them, then takes the user's optimizer step on the averaged
gradients) and adds ashl's methods on top (optimizer.py, ``_wrap_horovod``). This strategy
only watches: it counts steps, emulates heterogeneity, evaluates and decides when to stop.

Every step is one commit (one synchronous gradient exchange).

Stopping together. Every ``control_every`` steps (default 1: it is a few floats), after the
local update, every rank adds its control slots (control.py: losses, clocks, PRESENT, and
rank 0's evaluation of the model just updated) to a small float64 ``hvd.allreduce_``, and
every rank feeds them, in the same order, to its own StageMachine (``control.decide``; one
stage, no switch), so all ranks stop after the same step: target accuracy (the final model is the one
rank 0 evaluated; one evaluated in the background is taken at a later control round and its
starting copy is the final model), time budget, commit budget (steps * n), target loss. A rank that calls
``finish()`` early calls ``hvd.join()``: Horovod lets the others' allreduces complete
without it (zeros in its place), their next control round sees PRESENT < n, and they stop
on that step; ``finish()`` on every rank then meets in ``hvd.join()`` and ends with a
broadcast of rank 0's model (parameters and floating-point buffers: BatchNorm statistics
are not averaged by BSP).

Emulated heterogeneity (tests, benchmarks). Compute: the step is stretched after the local
update (StepClock). Link: ``hetero.depart(bytes of the gradients)`` sleeps in
``before_step()``, i.e. before step()'s ``synchronize()``, not inside backward where
Horovod has already handed the gradients to its background thread. Horovod starts each
gradient's allreduce as backward produces it, so on a real cluster the transfer runs beside
the backward pass: the sleep is the transfer time less the emulated backward pass
(``BACKWARD_SHARE`` of the rank's emulated step; of its last pass with
``backward_passes_per_step`` > 1, when the hooks start them; none when ashl averages after
backward, below), and a step lasts max(compute, forward + transfer). The allreduce of THIS
step may finish without waiting for the slow link, but the slow rank reaches its next
backward, and so submits the next step's gradients, that much later: in steady state every
step waits for the slowest rank's, as on a real slow link; only the first step differs.

A CUDA model under a Horovod built without GPU operations (no NCCL): Horovod's hooks
cannot take device gradients, so the wrapped optimizer is ashl's own. As the step's last
backward pass ends (``backward_passes_per_step``; post-accumulate-grad hooks queue one
autograd callback per pass) every gradient is gathered into one flat device buffer per
dtype, copied once to pinned host memory, averaged by one ``hvd.allreduce_``, copied back
and scattered into the gradients (staging.py). As with Horovod's hooks, GradScaler's inf
check (in ``scaler.step`` or ``unscale_``) then reads the same gradients on every rank, so
all ranks step or all skip; averaged in step(), a rank whose own gradients overflowed
would skip its allreduce and leave the others in theirs. ``synchronize()`` and ``step()``
average only what backward left unaveraged (a step of fewer passes). A gradient this
rank's backward did not reach is zeros, as in Horovod. A sparse gradient (an Embedding's
with sparse=True) is averaged dense and given back sparse, or left dense with
``sparse_as_dense``. One collective a step instead of one per tensor, none of it overlapped
with backward. Said once in the log.

``opt.stage`` reads "TRAIN" while training and "DONE" at the end.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from .. import kernels
from ..compression import check_compression
from ..emulation import BACKWARD_SHARE
from ..stages import Stage, StageConfig, StageMachine
from .base import Strategy
from .control import LEFT_EARLY, ControlSlots, decide, last_decisions
from .join import horovod_join
from .runtime import horovod, horovod_staging, world_comm

_CONTROL_NAME = "ashl.bsp.control"
_FINAL_NAME = "ashl.bsp.final"
_GRADS_NAME = "ashl.bsp.grads"


class BspStrategy(Strategy):
    name = "bsp"
    single_stage = True
    first_round_within_pass = False        # every step is a round, in lockstep
    accepts_compression = ("none", "fp16")   # Horovod's own, on the gradients
    backward_passes_per_step = 1            # DistributedOptimizer's, set after construction
    sparse_as_dense = False                 # DistributedOptimizer's, set after construction

    def __init__(self, model, params, *, sampler=None, comm=None,
                 stage_config: Optional[StageConfig] = None, evaluate=None,
                 eval_every_s: float = 2.0, control_every: int = 1, heterogeneity=None,
                 compression=None, hvd=None, profile_steps=None, planner_config=None,
                 drift_config=None):
        del profile_steps, planner_config, drift_config   # nothing to profile or plan
        world = world_comm(comm)
        super().__init__(model, params, comm=world, sampler=sampler, heterogeneity=heterogeneity,
                         evaluate=evaluate, eval_every_s=eval_every_s, control_rank=0,
                         stage_config=stage_config)
        self.hvd = horovod(self.name, world) if hvd is None else hvd
        self.staging = horovod_staging(self.hvd, self.device, self.name)
        self.compression = check_compression(compression, self.name, self.accepts_compression)
        if isinstance(control_every, bool) or not isinstance(control_every, int) or control_every < 1:
            raise ValueError(f"control_every must be an integer >= 1, got {control_every!r}")
        self.stage_config = dataclasses.replace(
            StageConfig() if stage_config is None else stage_config, switch=False)
        self._machine = StageMachine(self.size, self.stage_config, start_time=0.0)
        self.control_every = control_every
        self.slots = ControlSlots(self.size)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        self.t0 = time.monotonic()
        self._t_before = 0.0
        self._wall_before = time.time()
        self._passes = 0              # backward passes since the gradients were averaged
        self._just_evaluated = None   # rank 0: the copy a background evaluation started from
        self._evaluated_model = None  # rank 0: the model that met the target, if copied
        self._averaged = False        # the gradients hold the average of this step's passes
        self._awaited = None          # the backward pass whose end is awaited
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for p in params if p.requires_grad] if self.staged_gradients else []

    def machine(self) -> StageMachine:
        return self._machine

    @property
    def staged_gradients(self) -> bool:
        """Does ashl average the gradients through host memory (Horovod cannot take them)?"""
        return self.staging.staged

    def average_gradients(self) -> None:
        """Staged BSP, synchronize() or step(): the gradients averaged, unless the end of
        the step's backward passes averaged them already."""
        if not self._averaged:
            self._average()

    def _grad_ready(self, param) -> None:
        """A gradient was accumulated (autograd's hook): average them all when this backward
        pass ends (module docstring)."""
        self._averaged = False
        task = torch._C._current_graph_task_id()   # once per pass (one a failed pass left)
        if task != self._awaited:
            self._awaited = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        # Not after the run's end (the loop may go on, with no one to average with), nor
        # for a DistributedOptimizer that failed after building this strategy.
        self._passes += 1
        if (self._passes >= self.backward_passes_per_step and not self.finished
                and self.optimizer is not None):
            self._average()

    def _average(self) -> None:
        """Every parameter's gradient replaced by its average over the ranks, in one
        allreduce per gradient dtype (module docstring)."""
        self._passes, self._averaged = 0, True
        params = [p for p in self.optimizer_params() if p.requires_grad]
        sparse = []
        for p in params:
            if p.grad is None:    # the same tensors on every rank: zeros, as Horovod's
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:   # averaged dense (one flat allreduce), given back sparse
                sparse.append((p, p.grad.sparse_dim()))   # an Embedding's: by row
                p.grad = p.grad.to_dense()
        grads = [p.grad for p in params]
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, group in by_dtype.items():
            flat = torch.cat([g.reshape(-1) for g in group])
            summed = self.staging.to_host_flat(flat, f"grads.{dtype}")
            sent = summed.half() if self.compression is not None and \
                self.compression.name == "fp16" else summed   # Horovod's fp16, on the wire
            self.hvd.allreduce_(sent, op=self.hvd.Sum, name=f"{_GRADS_NAME}.{dtype}")
            if sent is not summed:
                summed.copy_(sent)
            summed.div_(self.size)
            self.staging.from_host(flat, summed)
            torch._foreach_copy_(group, [part.view_as(g) for part, g in
                                         zip(flat.split([g.numel() for g in group]), group)])
        if not self.sparse_as_dense:   # a sparse optimizer (SparseAdam) takes sparse gradients
            for p, sparse_dim in sparse:
                p.grad = p.grad.to_sparse(sparse_dim=sparse_dim)

    def optimizer_params(self) -> list:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def horovod_optimizer(self) -> bool:
        """Is the optimizer being stepped Horovod's (its synchronize and step functions)?"""
        from horovod.torch.optimizer import _DistributedOptimizer as H
        cls = type(self.optimizer) if self.optimizer is not None else None
        return (cls is not None and cls.__dict__.get("synchronize") is H.synchronize
                and cls.__dict__.get("_ashl_step") is H.step)

    @property
    def horovod_compression(self):
        """Horovod's compressor for the gradient allreduces (ashl's fp16 is Horovod's)."""
        fp16 = self.compression is not None and self.compression.name == "fp16"
        return self.hvd.Compression.fp16 if fp16 else self.hvd.Compression.none

    def set_epoch(self, epoch: int) -> None:
        pass

    # ---------------------------------------------------------------- driving
    def before_step(self) -> None:
        super().before_step()
        self._t_before = time.perf_counter()
        self._wall_before = time.time()
        self.hetero.depart(self.grad_bytes, overlapped_s=self._backward_s(self._t_before))

    def _backward_s(self, now: float) -> float:
        """The emulated backward pass that Horovod's allreduces run beside: the step's last
        (its hooks start them only then); none when ashl averages after backward (staged)."""
        if self.staged_gradients:
            return 0.0
        real = now - self.clock.last_end
        step = real if self.slowdown is None else self.slowdown.emulated(real)
        return BACKWARD_SHARE * step / self.backward_passes_per_step

    def after_step(self, loss) -> None:
        # Link delay + synchronize + the update itself: communication, not compute.
        self.clock.exclude(time.perf_counter() - self._t_before)
        self.commits += 1                 # every step is one gradient exchange
        self.bytes_sent += self.grad_bytes
        super().after_step(loss)
        if self.round_steps:              # no control this step: the step's own spans
            self.round_span(self._wall_before, steps=1, bytes=self.grad_bytes,
                            step=self.local_steps)

    def local_steps_target(self) -> int:
        return self.control_every

    def _make_plan(self) -> None:
        """Nothing to plan: training started with the first step."""
        self.stage = Stage.AHL           # "TRAIN" (the engine's one training stage)

    def _exchange(self, final: bool = False) -> None:
        """The tiny allreduce, then the same decisions on every rank."""
        if final:                         # a leaving rank joins instead (_final_model)
            self._machine.stop(time.monotonic() - self.t0, LEFT_EARLY)
            return
        steps, self.round_steps = self.round_steps, 0
        control = self.slots.encode(
            self.rank, loss=self.loss.commit(), busy=0.0, control=self.rank == 0,
            elapsed=time.monotonic() - self.t0,
            accuracy=self._evaluation() if self.rank == 0 else None)
        self.hvd.allreduce_(control, op=self.hvd.Sum, name=_CONTROL_NAME)
        self.bytes_sent += control.numel() * control.element_size()
        reading = self.slots.decode(control)
        decide(self._machine, reading, commits_per_rank=steps, training_reason="bsp: training")
        if self.rank == 0 and self._machine.done and reading.accuracy is not None \
                and self._machine.stop_reason.startswith("target accuracy"):
            self._evaluated_model = self._just_evaluated   # rank 0's final broadcast sends it
        if reading.accuracy is not None:
            self.timeline.instant("eval", accuracy=reading.accuracy)
        self.round_span(self._wall_before, steps=steps, bytes=self.grad_bytes,
                        step=self.local_steps)
        self._follow_machine(self._machine)

    def _evaluation(self) -> Optional[float]:
        """Rank 0: the accuracy of an evaluation done by now (one in the background is taken
        at a later control round, the others stepping on meanwhile), and which model it was."""
        keep = self.stage_config.target_accuracy is not None
        self.evaluations.start(save=self.flat_model if keep else None)
        accuracy = self.evaluations.take(wait=False)
        self._just_evaluated = self.evaluations.saved    # None: the model held now
        self.evaluations.saved = None
        return accuracy

    # ------------------------------------------------------------------ the end
    def _final_model(self) -> None:
        """Every rank meets in hvd.join() (a rank leaving early is seen by the others' next
        control round: it contributes nothing), then all take rank 0's model (parameters and
        floating-point buffers: BatchNorm statistics are not averaged by BSP)."""
        horovod_join(self.hvd, self.staging)
        self._machine = last_decisions(self.comm, self._machine)
        model = self.flat_model() if self._evaluated_model is None else self._evaluated_model
        flat = self.staging.to_host_flat(model, "final")
        self.hvd.broadcast_(flat, root_rank=0, name=_FINAL_NAME)
        kernels.unpack_assign(self.tensors, [torch.zeros_like(t) for t in self.tensors],
                              self.staging.to_device(flat, "final"))

    def _close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def counters(self) -> dict:
        c = super().counters()
        c.update(horovod_optimizer=self.horovod_optimizer,
                 optimizer_class=[f"{k.__module__}.{k.__qualname__}"
                                  for k in type(self.optimizer).__mro__]
                 if self.optimizer is not None else None)
        return c
