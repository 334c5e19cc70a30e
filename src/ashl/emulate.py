"""``python -m ashl.emulate SCRIPT [ARGS...]``: run any training script, unchanged, with the
per-rank compute slowdowns of ``ASHL_EMULATE_COMPUTE`` (e.g. ``1,2,4``) applied to its steps
(and the GPU-like step time of ``ASHL_EMULATE_STEP_TIME``, if set).

ashl's strategies read that variable themselves; this runner gives the same emulated cluster
to a script that does not use ashl, such as the plain Horovod script a benchmark compares
ashl with. On a rank with factor f every training step takes about f times its real compute
(f x the step time, when one is set): before each backward pass the rank sleeps what the
previous step's compute (from the end of one optimizer step to the end of the next backward
pass) left of that, as ashl's ComputeSlowdown reckons it. The sleep comes before
the backward pass, so gradients are ready as late as a slower GPU's would be (Horovod starts
its allreduces during backward).
"""
from __future__ import annotations

import os
import runpy
import sys
import time

import torch

from .emulation import ComputeSlowdown, compute_factor_from_env, step_time_from_env

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    for name in _RANK_VARS:
        if name in os.environ:
            return int(os.environ[name])
    return 0


class SlowSteps:
    """Stretches every step of this process as `slowdown` says (installed by ``install``)."""

    def __init__(self, slowdown: ComputeSlowdown, clock=time.perf_counter, sleep=time.sleep):
        self.slowdown, self.clock, self.sleep = slowdown, clock, sleep
        self.step_end = clock()
        self.last_compute: float | None = None

    def before_backward(self) -> float:
        """Sleep for the previous step's stretch; returns the seconds slept."""
        if self.last_compute is None:
            return 0.0                         # the first step: nothing measured yet
        extra = self.slowdown.extra(self.last_compute)
        if extra > 0:
            self.sleep(extra)
        return extra

    def after_backward(self, slept: float) -> None:
        self.last_compute = max(0.0, self.clock() - self.step_end - slept)

    def after_step(self) -> None:
        self.step_end = self.clock()

    def install(self) -> None:
        backward = torch.Tensor.backward

        def slow_backward(tensor, *args, **kwargs):
            slept = self.before_backward()
            out = backward(tensor, *args, **kwargs)
            self.after_backward(slept)
            return out

        torch.Tensor.backward = slow_backward
        from torch.optim.optimizer import register_optimizer_step_post_hook
        register_optimizer_step_post_hook(
            lambda *_: self.after_step())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0])
        return 0 if argv else 2
    try:
        slowdown = ComputeSlowdown(compute_factor_from_env(launcher_rank()),
                                   step_s=step_time_from_env())
    except ValueError as exc:           # a mistyped ASHL_EMULATE_* variable
        print(f"ashl.emulate: error: {exc}", file=sys.stderr)
        return 2
    if slowdown.active:
        SlowSteps(slowdown).install()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))   # as `python SCRIPT` does
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
