"""What every training strategy shares: the state that travels, step timing, counters.

A strategy is driven by the wrapped optimizer: ``before_step()`` when ``step()`` is entered
and ``after_step(loss)`` after the local update. It decides when to communicate and how.
"""
from __future__ import annotations

import socket
import time
from typing import Optional, Sequence

import torch

from .. import kernels
from ..emulation import ComputeSlowdown, Heterogeneity
from ..stages import RunningLoss, Stage


def model_state_tensors(model: Optional[torch.nn.Module],
                        params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters, then the model's floating-point buffers (BatchNorm running statistics):
    both travel and are averaged. Integer buffers (num_batches_tracked) stay local."""
    tensors = [p.data for p in params]
    seen = {t.data_ptr() for t in tensors}
    if model is not None:
        for _, b in model.named_buffers():
            if b.is_floating_point() and b.data_ptr() not in seen and b.numel() > 0:
                tensors.append(b.data)
                seen.add(b.data_ptr())
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(f"state tensor {i} (shape {tuple(t.shape)}) is not contiguous")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"state tensor {i} has dtype {t.dtype}; ashl averages float32, "
                             "float16 and bfloat16 tensors")
    return tensors


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
        self.tensors = model_state_tensors(model, params)
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
