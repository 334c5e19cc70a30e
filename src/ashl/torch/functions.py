"""Horovod's broadcast helpers, re-exported so a script needs only ``ashl.torch``."""
from __future__ import annotations


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Broadcast a state_dict or named parameters from root_rank (horovod's, unchanged)."""
    import horovod.torch as hvd
    hvd.broadcast_parameters(params, root_rank=root_rank)


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    import horovod.torch as hvd
    hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
