"""What every training strategy shares: the state that travels, step timing, counters.

A strategy is driven by the wrapped optimizer: ``before_step()`` when ``step()`` is entered
and ``after_step(loss)`` after the local update. It decides when to communicate and how.
"""
from __future__ import annotations

import math
import socket
import time
from typing import Optional, Sequence

import torch

from .. import kernels
from ..emulation import ComputeSlowdown, Heterogeneity
from ..stages import RunningLoss, Stage


def model_state(model: Optional[torch.nn.Module],
                params: Sequence[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of what travels: the parameters, then the model's floating-point
    buffers (BatchNorm running statistics), which are averaged too. Integer buffers
    (num_batches_tracked) stay local."""
    names_of = {}
    if model is not None:
        names_of = {p.data_ptr(): n for n, p in model.named_parameters()}
    tensors = [p.data for p in params]
    names = [names_of.get(t.data_ptr(), f"param[{i}]") for i, t in enumerate(tensors)]
    seen = {t.data_ptr() for t in tensors}
    if model is not None:
        for name, b in model.named_buffers():
            if b.is_floating_point() and b.data_ptr() not in seen and b.numel() > 0:
                tensors.append(b.data)
                names.append(name)
                seen.add(b.data_ptr())
    for name, t in zip(names, tensors):
        if not t.is_contiguous():
            raise ValueError(f"{name} (shape {tuple(t.shape)}) is not contiguous")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} has dtype {t.dtype}; ashl averages float32, "
                             "float16 and bfloat16 tensors")
    return names, tensors


def model_state_tensors(model: Optional[torch.nn.Module],
                        params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return model_state(model, params)[1]


def signature(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> list[tuple]:
    return [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in zip(names, tensors)]


def signature_mismatch(signatures: Sequence[Sequence[tuple]]) -> Optional[str]:
    """None if every rank's model signature equals rank 0's, else a message naming the
    first differing tensor and the ranks involved."""
    ref = signatures[0]
    for rank, sig in enumerate(signatures[1:], start=1):
        for i in range(max(len(ref), len(sig))):
            a = ref[i] if i < len(ref) else None
            b = sig[i] if i < len(sig) else None
            if a == b:
                continue
            if a is None or b is None:
                return (f"model mismatch: rank {rank} has {len(sig)} tensors to average but "
                        f"rank 0 has {len(ref)} (first extra: {(a or b)[0]!r})")
            what = ("name" if a[0] != b[0] else "shape" if a[1] != b[1] else "dtype")
            return (f"model mismatch at tensor {i}: rank {rank} has {b[0]!r} {b[1]} {b[2]}, "
                    f"rank 0 has {a[0]!r} {a[1]} {a[2]} (the {what} differs)")
    return None


def verify_same_model(comm, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Collective, at start: every rank must train the same model (names, shapes, dtypes,
    order). On a mismatch every rank raises the same error, at once."""
    problem = signature_mismatch(comm.allgather(signature(names, tensors)))
    if problem is not None:
        raise ValueError(problem)


class StepClock:
    """Compute seconds per local step: from the end of one step() to the end of the next,
    less the communication inside it (so forward, backward and data loading all count)."""

    def __init__(self):
        self.last_end = time.perf_counter()
        self.round_compute = 0.0
        self.round_steps = 0
        self.total_compute = 0.0
        self.comm_s = 0.0

    def restart(self) -> None:
        """At the first step(): whatever came before (imports, broadcasts, waiting for the
        other ranks to start) is not compute, and an emulated slowdown must not stretch it."""
        self.last_end = time.perf_counter()

    def step_done(self, slowdown: Optional[ComputeSlowdown] = None) -> float:
        """The step that just ended; an emulated slowdown stretches it first."""
        if slowdown is not None and slowdown.factor != 1.0:
            slowdown.stretch(self.last_end)
        now = time.perf_counter()
        dt = now - self.last_end
        self.last_end = now
        self.round_compute += dt
        self.round_steps += 1
        self.total_compute += dt
        return dt

    def exclude(self, seconds: float) -> None:
        """Time spent communicating inside step(): not compute."""
        self.last_end += seconds
        self.comm_s += seconds

    def round_mean(self) -> Optional[float]:
        return self.round_compute / self.round_steps if self.round_steps else None

    def new_round(self) -> None:
        self.round_compute, self.round_steps = 0.0, 0


class Strategy:
    """Base class: counters and the properties the optimizer exposes."""

    name = "base"

    def __init__(self, model, params, *, sampler=None, rank: int = 0, size: int = 1,
                 heterogeneity: Optional[Heterogeneity] = None):
        self.model = model
        self.names, self.tensors = model_state(model, params)
        self.numel = kernels.flat_numel(self.tensors)
        self.sampler = sampler
        self.rank, self.size = rank, size
        self.stage = Stage.PROFILE
        self.plan = None
        self.finished = False
        self.local_steps = 0        # all local steps of this rank
        self.commits = 0
        self.clock = StepClock()
        self.loss = RunningLoss()
        self.host = socket.gethostname()
        self.optimizer = None        # the wrapped optimizer, set by DistributedOptimizer
        self.epoch = 0
        # Emulated hardware (tests, benchmarks): explicit, else ASHL_EMULATE_* variables.
        self.hetero = heterogeneity if heterogeneity is not None else Heterogeneity.from_env(rank)
        self.slowdown = (ComputeSlowdown(self.hetero.compute_factor)
                         if self.hetero.compute_factor != 1.0 else None)

    def step_done(self) -> float:
        """Count a local step's compute (stretched by any emulated slowdown)."""
        return self.clock.step_done(self.slowdown)

    def link_departure(self, nbytes: int) -> None:
        """An emulated slow link: the message leaves only after its transfer time."""
        delay = self.hetero.link_delay(nbytes)
        if delay > 0:
            time.sleep(delay)

    def link_arrival(self, sent_at: float, nbytes: int) -> None:
        """An emulated slow link: a message sent at `sent_at` (time.monotonic, host-wide) is
        not delivered before sent_at + its transfer time."""
        if self.hetero.link is not None:
            from ..emulation import sleep_until
            sleep_until(sent_at + self.hetero.link_delay(nbytes))

    def clear_nonfinite_optimizer_state(self) -> int:
        """After a rejected (NaN/Inf) delta the parameters come back from the global model,
        but momentum and similar buffers would re-poison them: zero every optimizer state
        tensor that holds a non-finite value. Returns how many were cleared."""
        cleared = 0
        for state in getattr(self.optimizer, "state", {}).values():
            for value in state.values():
                if (isinstance(value, torch.Tensor) and value.is_floating_point()
                        and not bool(torch.isfinite(value).all())):
                    value.zero_()
                    cleared += 1
        return cleared

    @property
    def stage_label(self) -> str:
        """What ``opt.stage`` shows: the stage's name (baselines: "TRAIN", then "DONE")."""
        return self.stage.value

    def set_epoch(self, epoch: int) -> None:
        """The training epoch, reported with commits (as a sampler is told)."""
        self.epoch = int(epoch)

    # driven by the optimizer
    def before_step(self) -> None:
        pass

    def after_step(self, loss) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        self.finished = True

    def counters(self) -> dict:
        return {"local_steps": self.local_steps, "commits": self.commits,
                "compute_s": self.clock.total_compute, "comm_s": self.clock.comm_s}


def loss_value(loss) -> Optional[float]:
    if loss is None:
        return None
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


class RoundStrategy(Strategy):
    """Profile with real steps, then rounds: local steps until ``_round_done()``, then one
    exchange (``_end_round()``: a commit to the server, or an allreduce). Communication
    inside step() is excluded from the compute clock."""

    def __init__(self, model, params, **kwargs):
        super().__init__(model, params, **kwargs)
        from ..profiler import RankProfiler
        self.profiler = RankProfiler(name=self.host)
        self.round_steps = 0

    def local_steps_target(self) -> int:
        raise NotImplementedError

    def _round_done(self) -> bool:
        """After this rank's H_i local steps (a time-based strategy overrides this)."""
        return self.round_steps >= self.local_steps_target()

    def _make_plan(self) -> None:
        raise NotImplementedError

    def _end_round(self) -> None:
        raise NotImplementedError

    def after_step(self, loss) -> None:
        if self.finished:
            raise RuntimeError("this optimizer has finished (opt.finished is True); "
                               "stop the training loop")
        dt = self.step_done()
        self.local_steps += 1
        self.round_steps += 1
        value = loss_value(loss)
        if value is not None and math.isfinite(value):
            self.loss.add(value)
        if self.stage == Stage.PROFILE:
            self.profiler.record("compute", dt)
        if self._round_done():
            t0 = time.perf_counter()
            if self.stage == Stage.PROFILE:
                self._make_plan()
            self._end_round()
            self.clock.exclude(time.perf_counter() - t0)
