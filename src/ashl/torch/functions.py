"""Horovod's broadcast helpers, re-exported so a script needs only ``ashl.torch``; where
Horovod is not initialised (a parameter-server strategy needs none), the same broadcast
over mpi4py's world."""
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


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Broadcast a state_dict or named parameters from root_rank (Horovod's, unchanged)."""
    hvd = _horovod()
    if hvd is not None:
        hvd.broadcast_parameters(params, root_rank=root_rank)
        return
    from mpi4py import MPI
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    for _, tensor in items:   # once, at the start: a copy per tensor is no matter
        if not isinstance(tensor, torch.Tensor):
            continue
        host = tensor.detach().to("cpu", copy=True).contiguous()
        MPI.COMM_WORLD.Bcast(host.view(-1).view(torch.uint8).numpy(), root=root_rank)
        tensor.data.copy_(host)


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    import horovod.torch as hvd
    hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
