"""Outer optimizers: what the global model does with a merged update.

A merge hands the outer optimizer ``u = weight * delta`` (the merge weight and the staleness
damping already in ``weight``; ``delta`` dense or top-k sparse, a ``compression.Payload``).
DiLoCo's pseudo-gradient is ``-delta``, so each rule below is the SGD rule of that name with
``grad = -u``:

    none                              W += u                              (ashl's merge)
    nesterov(lr, momentum)            m = b m + u;  W += lr (u + b m)     (torch SGD, nesterov)
    delayed-nesterov(lr, momentum, n) W += lr u; every n-th update also
                                      m = b m + sum of the n updates;  W += lr b m

Delayed Nesterov is Algorithm 3 of Liu et al. 2024 (Async Local-SGD): every arrival is
applied with plain outer SGD at once, and the momentum moves only every n arrivals, on their
sum, so over n arrivals W moves by lr (sum + b m), one Nesterov step on the n updates
together, and no single stale update can swing the momentum. With merge weights 1/n, the
sum is the paper's average of n pseudo-gradients. ``n`` defaults to the updates of one
round: the worker count on the parameter server, 1 in a synchronous round (every round is
one merged update, so delayed-nesterov(lr, b, 1) is nesterov(lr, b)).

The rule moves the parameters only, the first ``params_numel`` elements of the flat model:
the floating-point buffers behind them (BatchNorm's running statistics) are merged plainly,
``W += u``, since extrapolating a running variance with momentum could make it negative.

Every rule runs on the fused kernels and keeps the merge's guard: an update holding NaN/Inf
writes nothing (neither the model nor the momentum) and ``step`` returns False.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from . import kernels
from .compression import Payload
from .outer_spec import OuterSpec, parse_outer, resolve_outer

__all__ = ["OuterSpec", "parse_outer", "resolve_outer", "OuterOptimizer", "PlainMerge",
           "NesterovOuter", "DelayedNesterovOuter", "make_outer"]

log = logging.getLogger("ashl")


class OuterOptimizer:
    """``step(model, update, weight)``: apply ``weight * update`` to the flat fp32 model, the
    rule (``_step``) to its first ``params`` elements, the plain merge to the rest."""

    def __init__(self, spec: OuterSpec, numel: int, device="cpu",
                 params_numel: Optional[int] = None):
        self.spec, self.numel, self.device = spec, numel, torch.device(device)
        self.params = numel if params_numel is None else int(params_numel)
        if not 0 <= self.params <= numel:
            raise ValueError(f"params_numel {params_numel} outside a model of {numel} elements")
        self.updates = 0            # updates applied (rejected ones not counted)

    def step(self, model: torch.Tensor, update: Payload, weight: float) -> bool:
        if self.params == self.numel:
            ok = self._step(model, update, weight)
        else:
            head, tail = update.split(self.params)
            # the buffers' part is checked first, so a bad one writes nothing anywhere
            ok = tail.check() and self._step(model[:self.params], head, weight)
            if ok:
                tail.merge_into(model[self.params:], weight)
        self.updates += ok
        return ok

    def _step(self, params: torch.Tensor, update: Payload, weight: float) -> bool:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"spec": str(self.spec), "numel": self.numel, "params": self.params,
                "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's state; its rule and model layout must be this one's."""
        if (state.get("spec"), state.get("numel"), state.get("params")) != (
                str(self.spec), self.numel, self.params):
            raise ValueError(f"the checkpoint's outer optimizer is {state.get('spec')!r} on "
                             f"{state.get('numel')} elements ({state.get('params')} of them "
                             f"parameters); this run's is {str(self.spec)!r} on {self.numel} "
                             f"({self.params})")
        self.updates = int(state["updates"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"


class PlainMerge(OuterOptimizer):
    """``W += u``: the merge without an outer optimizer.

    A dense update of a large host model is merged into a second buffer, which then becomes
    the model's storage (``model.set_``: the caller's tensor holds the result, as after an
    in-place merge). Guarded in place, every delta element must be read once to check it
    before any is written, then again to merge: 16 bytes an element; into a second buffer
    the check and the merge share one read, 12 bytes. The price is a second model's memory
    on the server. On a GPU both ways take two passes, so it merges in place there."""

    # Below this, model and delta stay in the cache between the two passes of the in-place
    # merge, which then wins (docs/BENCHMARKS.md, "Kernels").
    double_buffer_numel = 1 << 22

    def __init__(self, spec: OuterSpec, numel: int, device="cpu",
                 params_numel: Optional[int] = None):
        super().__init__(spec, numel, device, params_numel)
        # the second buffer, made at the first merge that needs it (the averaging strategies
        # hold a PlainMerge that never merges: unpack_add is their plain merge)
        self.spare: Optional[torch.Tensor] = None

    def step(self, model, update, weight) -> bool:
        if update.sparse or not self._double_buffered(model):
            ok = update.merge_into(model, weight)
        else:
            if self.spare is None or self.spare.shape != model.shape \
                    or self.spare.dtype != model.dtype:
                self.spare = torch.empty_like(model)
            ok = update.merge_into(model, weight, out=self.spare)
            if ok:
                merged, self.spare = self.spare, model.detach()   # the old storage is spare
                model.set_(merged)
        self.updates += ok
        return ok

    def _double_buffered(self, model: torch.Tensor) -> bool:
        """A large host model that owns its whole storage: re-pointing it (set_) then leaves
        no other tensor on the old storage to miss the merge."""
        return (model.device.type == "cpu" and model.numel() >= self.double_buffer_numel
                and model.is_contiguous() and model._base is None
                and model.storage_offset() == 0
                and model.untyped_storage().nbytes() == model.numel() * model.element_size())


class _WithMomentum(OuterOptimizer):
    def __init__(self, spec: OuterSpec, numel: int, device="cpu",
                 params_numel: Optional[int] = None):
        super().__init__(spec, numel, device, params_numel)
        self.momentum = torch.zeros(self.params, dtype=torch.float32, device=self.device)

    def _momentum_step(self, model: torch.Tensor) -> None:
        """``W += lr b m``; a momentum that overflowed is dropped (the update stays)."""
        if not kernels.merge_dense(model, self.momentum, self.spec.lr * self.spec.momentum):
            log.warning("outer optimizer %s: the momentum overflowed; reset to 0", self.spec)
            self.momentum.zero_()

    def state_dict(self) -> dict:
        return dict(super().state_dict(), momentum=self.momentum.clone())

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.momentum.copy_(state["momentum"])   # to this run's device


class NesterovOuter(_WithMomentum):
    """``m = b m + u; W += lr (u + b m)`` on every update."""

    def _step(self, params, update, weight) -> bool:
        s = self.spec
        if not update.merge_into(params, s.lr * weight):     # the guard: nothing written
            return False
        kernels.weighted_sum(self.momentum, [self.momentum], [s.momentum])
        update.merge_into(self.momentum, weight)
        self._momentum_step(params)
        return True


class DelayedNesterovOuter(_WithMomentum):
    """``W += lr u`` on every update; every n-th, ``m = b m + sum; W += lr b m``."""

    def __init__(self, spec: OuterSpec, numel: int, device="cpu",
                 params_numel: Optional[int] = None):
        super().__init__(spec, numel, device, params_numel)
        self.n = spec.n
        self.buffer = torch.zeros(self.params, dtype=torch.float32, device=self.device)

    def _step(self, params, update, weight) -> bool:
        s = self.spec
        if not update.merge_into(params, s.lr * weight):
            return False
        update.merge_into(self.buffer, weight)
        if (self.updates + 1) % self.n == 0:     # this update is the n-th since the last
            kernels.weighted_sum(self.momentum, [self.momentum, self.buffer], [s.momentum, 1.0])
            self.buffer.zero_()
            self._momentum_step(params)
        return True

    def state_dict(self) -> dict:
        return dict(super().state_dict(), buffer=self.buffer.clone())

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.buffer.copy_(state["buffer"])


def make_outer(spec: "str | OuterSpec | None", numel: int, round_updates: int,
               device="cpu", params_numel: Optional[int] = None) -> OuterOptimizer:
    """The outer optimizer of `spec` for a flat model of `numel` elements on `device`, the
    first `params_numel` of them parameters (default: all), whose rounds merge
    `round_updates` updates (delayed-nesterov's default n)."""
    spec = resolve_outer(spec, round_updates)
    cls = {"none": PlainMerge, "nesterov": NesterovOuter,
           "delayed-nesterov": DelayedNesterovOuter}[spec.kind]
    return cls(spec, numel, device, params_numel)
