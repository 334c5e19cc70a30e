"""Horovod's broadcast helpers, re-exported so a script needs only ``ashl.torch``; where
Horovod is not initialised (a parameter-server strategy needs none), or cannot take the
tensors (a GPU model under a Horovod without GPU operations), the same broadcast over
mpi4py's world, through host memory."""
from __future__ import annotations

import sys

import torch


def _horovod():
    """horovod.torch if the script initialised it, else None."""
    hvd = sys.modules.get("horovod.torch")
    try:
        return hvd if hvd is not None and hvd.is_initialized() else None
    except Exception:   # an uninitialised or failed Horovod
        return None


def _horovod_takes(hvd, tensors) -> bool:
    """Can Horovod broadcast these tensors as they are (a GPU model needs its GPU operations)?"""
    from ..strategies.runtime import horovod_reduces_on
    return all(horovod_reduces_on(hvd, t.device, "broadcast_parameters")
               for t in tensors if isinstance(t, torch.Tensor))


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Broadcast a state_dict or named parameters from root_rank (Horovod's, unchanged)."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    hvd = _horovod()
    if hvd is not None and _horovod_takes(hvd, [t for _, t in items]):
        hvd.broadcast_parameters(params if isinstance(params, dict) else items,
                                 root_rank=root_rank)
        return
    from mpi4py import MPI
    for _, tensor in items:   # once, at the start: a copy per tensor is no matter
        if not isinstance(tensor, torch.Tensor):
            continue
        host = tensor.detach().to("cpu", copy=True).contiguous()
        MPI.COMM_WORLD.Bcast(host.view(-1).view(torch.uint8).numpy(), root=root_rank)
        tensor.data.copy_(host)


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    import horovod.torch as hvd
    hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
