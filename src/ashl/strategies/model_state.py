"""What travels: a model's parameters and floating-point buffers, and the check that every
rank trains the same model."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..kernels import FlatTensors, views_like

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["model_state", "store_flat", "signature", "signature_mismatch",
           "verify_same_model"]


def model_state(model: Optional[torch.nn.Module],
                params: Sequence[torch.Tensor]) -> tuple[list[str], Sequence[torch.Tensor]]:
    """(names, tensors) of what travels: the parameters, then the model's floating-point
    buffers (BatchNorm running statistics), which are averaged too. Integer buffers
    (num_batches_tracked) stay local. The tensors are FlatTensors when they are stored flat
    (``store_flat``), so that every kernel call runs on one buffer."""
    names, owners = _travelling(model, params)
    tensors = [t.data for t in owners]
    for name, t in zip(names, tensors):
        if not t.is_contiguous():
            raise ValueError(f"{name} (shape {tuple(t.shape)}) is not contiguous")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{name} has dtype {t.dtype}; ashl averages float32, "
                             "float16 and bfloat16 tensors")
    return names, FlatTensors.of(tensors) or tensors


def _travelling(model, params) -> tuple[list[str], list[torch.Tensor]]:
    """(names, the parameters and buffers themselves) of what travels, in its order."""
    names_of = {}
    if model is not None:
        names_of = {p.data_ptr(): n for n, p in model.named_parameters()}
    owners = list(params)
    names = [names_of.get(t.data_ptr(), f"param[{i}]") for i, t in enumerate(owners)]
    seen = {t.data_ptr() for t in owners}
    if model is not None:
        for name, b in model.named_buffers():
            if b.is_floating_point() and b.data_ptr() not in seen and b.numel() > 0:
                owners.append(b)
                names.append(name)
                seen.add(b.data_ptr())
    return names, owners


def store_flat(model: Optional[torch.nn.Module], params: Sequence[torch.Tensor]) -> Optional[str]:
    """Stores what travels in one new contiguous buffer, in its order: each parameter and
    buffer keeps its values and becomes a view of it (its ``.data`` re-pointed, as apex and
    FSDP do), so a commit's kernels run on one flat tensor, not one per tensor. Returns None
    when it did, else why not (the model is then left as it was). Whatever was derived from
    a tensor's storage before (``.data``, a view, a state_dict's tensors) no longer sees the
    model."""
    _, owners = _travelling(model, params)
    why = _why_not_flat(model, owners)
    if why is not None:
        return why
    first = owners[0]
    try:
        flat = torch.empty(sum(t.numel() for t in owners), dtype=first.dtype,
                           device=first.device)
    except RuntimeError as exc:   # torch's OutOfMemoryError: the old storage is still held
        if "out of memory" not in str(exc).lower():
            raise
        return f"no {first.device} memory for a second copy of the model while it moves"
    with torch.no_grad():
        for t, view in zip(owners, views_like(flat, owners)):
            view.copy_(t.data)
            t.data = view
    return None


def _why_not_flat(model, owners: list) -> Optional[str]:
    """Why `owners` cannot be stored flat, or None: each must own its whole storage, and no
    storage may hold two of the model's tensors (tied weights stay tied only in place)."""
    if not owners:
        return "nothing travels"
    if FlatTensors.of([t.data for t in owners]) is not None:
        return "stored flat already"
    first = owners[0]
    if len({id(t) for t in owners}) != len(owners):
        return "a parameter is listed twice"
    for t in owners:
        if t.dtype != first.dtype or t.device != first.device:
            return "its tensors differ in dtype or device"
        if t.dtype not in _FLOATS or t.numel() == 0:
            return "a tensor is empty or not fp32, fp16 or bf16"
        if (t.storage_offset() != 0 or not t.is_contiguous()
                or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            return "a tensor is a view of a larger storage"
    others = [] if model is None else [
        t for named in (model.named_parameters(remove_duplicate=False),
                        model.named_buffers(remove_duplicate=False)) for _, t in named]
    tensors = {id(t): t for t in [*owners, *others] if t.numel() > 0}.values()
    storages = [t.untyped_storage().data_ptr() for t in tensors]
    if len(set(storages)) != len(storages):
        return "two of its tensors share memory"
    return None


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
