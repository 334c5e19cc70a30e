"""Evaluation off the training path: ``evaluate=BackgroundEvaluator(model, accuracy_of)``.

The control rank's ``evaluate=`` callback holds that rank for a whole test pass, so the
rank that hosts the server and evaluates trains the least. A background evaluator copies
the model's parameters and buffers into its own copy of the model (one fused copy, the only
time the rank is held) and runs ``accuracy_of(copy)`` in a thread while the rank trains on.
The strategies take the accuracy when it is done (the parameter-server ones between later
steps, the averaging ones at their next exchange), and a run stopped on it ends with the
model that was evaluated. The thread runs with the caller's number of torch threads.
"""
from __future__ import annotations

import copy
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

__all__ = ["BackgroundEvaluator"]


class BackgroundEvaluator:
    """``evaluate=`` for ``DistributedOptimizer``: each call snapshots ``model`` and returns
    a Future of ``accuracy_of(snapshot)``. The snapshot is a private copy of the module in
    eval mode; ``accuracy_of`` must not touch the live model. One evaluation at a time: a
    call while one is in flight waits for it (the snapshot is not overwritten under it)."""

    def __init__(self, model: torch.nn.Module, accuracy_of: Callable[[torch.nn.Module], float]):
        self.model, self.accuracy_of = model, accuracy_of
        self.snapshot = copy.deepcopy(model).eval()
        self._live = list(model.state_dict(keep_vars=True).values())
        self._copies = list(self.snapshot.state_dict(keep_vars=True).values())
        threads = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ashl-evaluate",
                                        initializer=torch.set_num_threads,
                                        initargs=(threads,))
        self.evaluations = 0
        self.spent_s = 0.0          # the thread's seconds evaluating
        self._last: Optional[Future] = None

    @property
    def busy(self) -> bool:
        """An evaluation is in flight."""
        return self._last is not None and not self._last.done()

    def __call__(self) -> Future:
        if self._last is not None:
            futures.wait([self._last])
        with torch.no_grad():
            torch._foreach_copy_([t.detach() for t in self._copies],
                                 [t.detach() for t in self._live])
        ready = None
        if self._copies and self._copies[0].is_cuda:
            device = self._copies[0].device
            ready = (device, torch.cuda.Event())
            # the evaluation's stream waits for the copy on the GPU; the host does not
            ready[1].record(torch.cuda.current_stream(device))
        self.evaluations += 1
        self._last = self._pool.submit(self._evaluate, ready)
        return self._last

    def _evaluate(self, ready) -> float:
        if ready is not None:
            device, event = ready
            torch.cuda.set_device(device)
            torch.cuda.current_stream(device).wait_event(event)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                return float(self.accuracy_of(self.snapshot))
        finally:
            self.spent_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for an evaluation in flight and stop the thread."""
        self._pool.shutdown(wait=True)
