"""What travels: a model's parameters and floating-point buffers, and the check that every
rank trains the same model."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["model_state", "signature", "signature_mismatch",
           "verify_same_model"]


def model_state(model: Optional[torch.nn.Module],
                params: Sequence[torch.Tensor]) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of what travels: the parameters, then the model's floating-point
    buffers (BatchNorm running statistics), which are averaged too. Integer buffers
    (num_batches_tracked) stay local."""
    names_of = {}
    if model is not None:
        names_of = {p.data_ptr(): n for n, p in model.named_parameters()}
    tensors = [p.data for p in params]
    names = [names_of.get(t.data_ptr(), f"param[{i}]") for i, t in enumerate(tensors)]
    seen = {t.data_ptr() for t in tensors}
    if model is not None:
        for name, b in model.named_buffers():
            if b.is_floating_point() and b.data_ptr() not in seen and b.numel() > 0:
                tensors.append(b.data)
                names.append(name)
                seen.add(b.data_ptr())
    for name, t in zip(names, tensors):
        if not t.is_contiguous():
            raise ValueError(f"{name} (shape {tuple(t.shape)}) is not contiguous")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"{name} has dtype {t.dtype}; ashl averages float32, "
                             "float16 and bfloat16 tensors")
    return names, tensors


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
