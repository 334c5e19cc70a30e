"""Horovod's broadcast helpers, re-exported so a script needs only ``ashl.torch``; where
Horovod is not initialised (a parameter-server strategy needs none), or cannot take the
tensors (a GPU model under a Horovod without GPU operations), the same broadcast over
mpi4py's world, through host memory."""
from __future__ import annotations

import collections
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
    """Can Horovod broadcast these tensors as they are (a GPU model needs its GPU operations)
    on every rank? Collective: a rank on the CPU and one on a GPU must take the same path."""
    from ..strategies.runtime import horovod_reduces_on
    mine = all(horovod_reduces_on(hvd, t.device, "broadcast_parameters")
               for t in tensors if isinstance(t, torch.Tensor))
    return _on_every_rank(mine)


def _on_every_rank(verdict: bool) -> bool:
    from mpi4py import MPI
    return bool(MPI.COMM_WORLD.allreduce(bool(verdict), op=MPI.LAND))


def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Broadcast a state_dict, named parameters or parameters from root_rank (Horovod's,
    unchanged)."""
    items = _named_items(params)
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


def _named_items(params) -> list:
    """(name, tensor) pairs, sorted by name for a dict; a bare parameter gets name None (as
    Horovod takes both model.named_parameters() and model.parameters())."""
    if isinstance(params, dict):
        return sorted(params.items())
    if isinstance(params, torch.Tensor) or not hasattr(params, "__iter__"):
        raise ValueError(f"params must be a state_dict, named parameters or parameters, got "
                         f"{type(params).__name__}")
    items = [p if isinstance(p, tuple) else (None, p) for p in params]
    bad = next((p for p in items if len(p) != 2 or not isinstance(p[1], torch.Tensor)), None)
    if bad is not None:   # it would be skipped: nothing broadcast, no error
        raise ValueError(f"params: expected (name, tensor) pairs or tensors, got "
                         f"{bad[1] if len(bad) == 2 and bad[0] is None else bad!r:.80}")
    return items


def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None) -> None:
    """Broadcast an optimizer's state and options from root_rank: Horovod's where it takes
    the parameters and state as they are; else Horovod's recipe (an empty state is first
    made by one step on zero gradients) with the tensors through ``broadcast_parameters``
    (host memory, mpi4py) and the other values pickled. An ashl optimizer always takes the
    second way, with or without hvd.init(); Horovod's own function works on one too (its
    class says Horovod's module, so Horovod takes the torch optimizer's step)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    hvd = _horovod()
    if (hvd is not None and not hasattr(optimizer, "_ashl")
            and _horovod_takes(hvd, _optimizer_tensors(optimizer))):
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank, model=model)
        return
    if not optimizer.state:
        _make_state(optimizer, model)
    if not optimizer.state:
        return        # a stateless optimizer: nothing to broadcast (Horovod's rule)
    tensors, values = _state_parts(optimizer)
    broadcast_parameters(tensors, root_rank)
    from mpi4py import MPI
    for place, value in MPI.COMM_WORLD.bcast(values, root=root_rank).items():
        _assign(optimizer, place, value)


def _optimizer_tensors(optimizer) -> list:
    """The parameters, and the state's tensors (Adam's step may sit on the CPU)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return params + [v for s in optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)]


def _make_state(optimizer, model) -> None:
    """Horovod's: one step of the user's optimizer class on zero gradients (sparse ones for
    SparseAdam and a sparse Embedding's SGD), so every rank has the state's tensors."""
    sparse = set() if model is None else {
        id(p) for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    wrapped = hasattr(optimizer, "_ashl") or type(optimizer).__module__ == "horovod.torch.optimizer"
    # a wrapper's step() would communicate; its base class is the user's optimizer
    (super(type(optimizer), optimizer).step if wrapped else optimizer.step)()


def _state_parts(optimizer) -> tuple[dict, dict]:
    """The state's tensors, each under Horovod's key (`name.occurrence`), and its other
    values and the groups' options, each under its place (group, parameter, name): keys
    alike on every rank."""
    tensors, values = {}, {}
    seen = collections.Counter()
    for g, group in enumerate(optimizer.param_groups):
        values.update(((g, None, k), v) for k, v in group.items() if k != "params")
        for i, p in enumerate(group["params"]):
            for name, value in optimizer.state.get(p, {}).items():
                seen[name] += 1
                if isinstance(value, torch.Tensor):
                    tensors[f"{name}.{seen[name]}"] = value
                else:
                    values[(g, i, name)] = value
    return tensors, values


def _assign(optimizer, place: tuple, value) -> None:
    g, i, name = place
    group = optimizer.param_groups[g]
    if i is None:
        group[name] = value
    else:
        optimizer.state[group["params"][i]][name] = value
