"""Evaluation off the training path: ``evaluate=BackgroundEvaluator(model, accuracy_of)``.

The control rank's ``evaluate=`` callback holds that rank for a whole test pass, so the
rank that hosts the server and evaluates trains the least. A background evaluator copies
the model's parameters and buffers into its own copy of the model (one fused copy; the rank
is held for that, and for the rest of a previous evaluation if one is still running) and runs
``accuracy_of(copy)`` in a thread while the rank trains on. The strategies take the accuracy
when it is done (the parameter-server ones between later steps, the averaging ones at their
next exchange, bsp at a later control round), and a run stopped on it ends with the model
that was evaluated. The thread runs with the caller's number of torch threads.
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
        for module in self.snapshot.modules():
            # a buffer that is a view of a flat model (flat_storage) was copied with its
            # whole storage: its own copy holds just itself
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.clone()
        # parameters and every buffer, non-persistent ones too (a state_dict leaves them out)
        self._copies = _tensors(self.snapshot)
        threads = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ashl-evaluate",
                                        initializer=torch.set_num_threads,
                                        initargs=(threads,))
        self._device = self._copies[0].device if self._copies else torch.device("cpu")
        self._last: Optional[Future] = None
        self._finished_on_gpu = None  # the last evaluation's kernels, for the next copy to wait
        self.closed = False
        self.evaluations = 0
        self.spent_s = 0.0            # the thread's seconds evaluating

    @property
    def busy(self) -> bool:
        """An evaluation is in flight."""
        return self._last is not None and not self._last.done()

    def __call__(self) -> Optional[Future]:
        """A Future of the accuracy of the model as it is now; None once closed."""
        if self.closed:
            return None
        if self._last is not None:
            futures.wait([self._last])
        cuda = self._device.type == "cuda"
        if cuda and self._finished_on_gpu is not None:
            # the copy must not overwrite the snapshot under the last evaluation's kernels
            torch.cuda.current_stream(self._device).wait_event(self._finished_on_gpu)
        with torch.no_grad():
            # the live tensors as they are now: wrapping the optimizer may have moved them
            # into one flat buffer (flat_storage) after this evaluator was made
            torch._foreach_copy_(self._copies, _tensors(self.model))
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            # the evaluation's stream waits for the copy on the GPU; the host does not
            ready.record(torch.cuda.current_stream(self._device))
        self.evaluations += 1
        self._last = self._pool.submit(self._evaluate, ready)
        return self._last

    def _evaluate(self, ready) -> float:
        t0 = time.perf_counter()
        try:
            if ready is not None:
                torch.cuda.set_device(self._device)
                torch.cuda.current_stream(self._device).wait_event(ready)
            with torch.no_grad():
                return float(self.accuracy_of(self.snapshot))
        finally:
            if ready is not None:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self._device))
                self._finished_on_gpu = done
            self.spent_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for an evaluation in flight and stop the thread; later calls return None."""
        self.closed = True
        self._pool.shutdown(wait=True)


def _tensors(model: torch.nn.Module) -> list:
    """The parameters then the buffers, tied ones as often as they are named (the copy
    names the same ones), detached."""
    return ([p.detach() for _, p in model.named_parameters(remove_duplicate=False)]
            + [b.detach() for _, b in model.named_buffers(remove_duplicate=False)])
