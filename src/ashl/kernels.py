"""Validated entry points to ashl's fused multi-tensor kernels (``ashl._C``).

Every function takes whole tensor lists (a model's parameters) and runs one
native call per dtype group, on CPU (OpenMP + SIMD) or CUDA (one launch for
many tensors). Tensors are checked here, with errors that name the offending
tensor, before any memory is touched; the native code checks bounds again.

Flat layout: tensor ``i`` of a list occupies ``flat[off_i : off_i + numel_i]``
with ``off_i`` the sum of the previous numels (back to back, list order).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from . import _C

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]

_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int32: 3, torch.int64: 4}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)

__all__ = [
    "pack_delta", "unpack_assign", "unpack_add", "merge_dense", "merge_sparse",
    "weighted_sum", "flat_numel", "flat_offsets", "cuda_available", "set_num_threads",
    "num_threads",
    "cpu_isa",
    "set_cpu_isa",
    "supported_cpu_isas",
]


def cuda_available() -> bool:
    """True when ashl was built with CUDA and a device is present."""
    return bool(_C.built_with_cuda) and _C.cuda.available()


def num_threads() -> int:
    return _C.cpu.max_threads()


def set_num_threads(n: int) -> None:
    """Threads used by the CPU kernels (default: OpenMP's, i.e. OMP_NUM_THREADS or all cores)."""
    _C.cpu.set_num_threads(int(n))


def cpu_isa() -> str:
    """The instruction set of the CPU kernels' fp16/bf16 conversions: ``avx512``, ``f16c`` or
    ``portable`` (the best this CPU supports unless set_cpu_isa chose)."""
    return _C.cpu.isa()


def set_cpu_isa(name: str) -> None:
    """Force the fp16/bf16 conversion path (``auto`` restores the best supported); for tests
    and benchmarks. Every path gives the same bits."""
    _C.cpu.set_isa(str(name))


def supported_cpu_isas() -> list[str]:
    """The paths this CPU can run, best first (``portable`` is always there)."""
    return _C.cpu.supported_isas().split(", ")


def flat_numel(tensors: TensorOrList) -> int:
    return sum(t.numel() for t in _as_list(tensors, "tensors"))


def flat_offsets(tensors: TensorOrList) -> list[int]:
    offsets, off = [], 0
    for t in _as_list(tensors, "tensors"):
        offsets.append(off)
        off += t.numel()
    return offsets


# --- validation ---------------------------------------------------------------

def _as_list(x, name: str) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return list(x)
    raise TypeError(f"{name} must be a tensor or a list of tensors, got {type(x).__name__}")


def _check(t, name: str, device: torch.device, dtypes=_FLOATS) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is not a tensor (got {type(t).__name__})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other tensors are on {device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has unsupported dtype {str(t.dtype).replace('torch.', '')}"
                         f" (expected {allowed})")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (call .contiguous() first)")


def _check_flat(t, name: str, device: torch.device, needed: int) -> None:
    _check(t, name, device)
    if t.numel() < needed:
        raise ValueError(f"{name} has {t.numel()} elements but the tensors need {needed}")


def _check_pair(ref: list, other: list, ref_name: str, other_name: str, device,
                same_dtype: bool) -> None:
    if len(other) != len(ref):
        raise ValueError(f"{other_name} has {len(other)} tensors but {ref_name} has {len(ref)}")
    for i, (r, o) in enumerate(zip(ref, other)):
        _check(o, f"{other_name}[{i}]", device)
        if o.numel() != r.numel():
            raise ValueError(f"{other_name}[{i}] has {o.numel()} elements but "
                             f"{ref_name}[{i}] has {r.numel()}")
        if same_dtype and o.dtype != r.dtype:
            raise ValueError(f"{other_name}[{i}] is {_name(o.dtype)} but "
                             f"{ref_name}[{i}] is {_name(r.dtype)}")


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _device_of(tensors: list, fallback, name: str) -> torch.device:
    first = tensors[0] if tensors else fallback
    if first is None:
        return torch.device("cpu")  # an empty list: nothing to run anywhere
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"{name}[0] is not a tensor (got {type(first).__name__})")
    return first.device


# --- native calls ---------------------------------------------------------------

def _native_list(tensors: list, idx: list[int], dtype) -> "_C.TensorList":
    return _C.TensorList(_CODES[dtype], [tensors[i].data_ptr() for i in idx],
                         [tensors[i].numel() for i in idx])


def _flat(t: torch.Tensor) -> "_C.Flat":
    return _C.Flat(t.data_ptr(), _CODES[t.dtype], t.numel())


def _groups(tensors: list) -> dict:
    """Indices of the tensors of each dtype (almost always a single group)."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


_scratch: dict = {}


def _cuda_args(device: torch.device) -> tuple[int, int]:
    """(stream, scratch) for a CUDA call: the current stream and 4 zeroed int32 flags."""
    scratch = _scratch.get(device)
    if scratch is None:
        scratch = _scratch[device] = torch.zeros(4, dtype=torch.int32, device=device)
    scratch.zero_()
    return torch.cuda.current_stream(device).cuda_stream, scratch.data_ptr()


def _call(device: torch.device, op: str, *args):
    if device.type == "cpu":
        return getattr(_C.cpu, op)(*args)
    if device.type == "cuda":
        if not cuda_available():
            raise RuntimeError("ashl was built without CUDA (or no device is visible); "
                               "rebuild with nvcc on PATH and ASHL_WITH_CUDA=on")
        with torch.cuda.device(device):
            return getattr(_C.cuda, op)(*args, *_cuda_args(device))
    raise ValueError(f"unsupported device {device} (expected cpu or cuda)")


# --- public kernels ----------------------------------------------------------------

def pack_delta(params: TensorOrList, anchors: TensorOrList, out: torch.Tensor,
               scale: float = 1.0, residuals: TensorOrList | None = None) -> torch.Tensor:
    """``out[flat] = scale * (p - a) + r`` for every tensor, in one pass."""
    params, anchors = _as_list(params, "params"), _as_list(anchors, "anchors")
    res = None if residuals is None else _as_list(residuals, "residuals")
    device = _device_of(params, out, "params")
    for i, p in enumerate(params):
        _check(p, f"params[{i}]", device)
    _check_pair(params, anchors, "params", "anchors", device, same_dtype=True)
    if res is not None:
        _check_pair(params, res, "params", "residuals", device, same_dtype=True)
    offsets = flat_offsets(params)
    _check_flat(out, "out", device, offsets[-1] + params[-1].numel() if params else 0)
    for dtype, idx in _groups(params).items():
        _call(device, "pack_delta", _native_list(params, idx, dtype),
              _native_list(anchors, idx, dtype),
              None if res is None else _native_list(res, idx, dtype),
              [offsets[i] for i in idx], _flat(out), float(scale))
    return out


def _unpack(op: str, params, anchors, flat) -> None:
    params, anchors = _as_list(params, "params"), _as_list(anchors, "anchors")
    device = _device_of(params, flat, "params")
    for i, p in enumerate(params):
        _check(p, f"params[{i}]", device)
    _check_pair(params, anchors, "params", "anchors", device, same_dtype=True)
    offsets = flat_offsets(params)
    _check_flat(flat, "flat", device, offsets[-1] + params[-1].numel() if params else 0)
    for dtype, idx in _groups(params).items():
        _call(device, op, _native_list(params, idx, dtype), _native_list(anchors, idx, dtype),
              [offsets[i] for i in idx], _flat(flat))


def unpack_assign(params: TensorOrList, anchors: TensorOrList, flat: torch.Tensor) -> None:
    """``p = a = flat[slice]`` for every tensor."""
    _unpack("unpack_assign", params, anchors, flat)


def unpack_add(params: TensorOrList, anchors: TensorOrList, flat: torch.Tensor) -> None:
    """``a += flat[slice]; p = a`` for every tensor."""
    _unpack("unpack_add", params, anchors, flat)


def merge_dense(dst: TensorOrList, delta: TensorOrList, weight: float) -> bool:
    """``dst += weight * delta``; if ``delta`` holds any NaN/Inf, writes nothing, returns False."""
    dst, delta = _as_list(dst, "dst"), _as_list(delta, "delta")
    device = _device_of(dst, None, "dst")
    for i, d in enumerate(dst):
        _check(d, f"dst[{i}]", device)
    _check_pair(dst, delta, "dst", "delta", device, same_dtype=False)
    groups = _groups_by_pair(dst, delta)
    if len(groups) > 1:
        # All-or-nothing across dtype groups: check every delta before merging any.
        if not all(bool(torch.isfinite(t).all()) for t in delta):
            return False
    ok = True
    for (dd, ed), idx in groups.items():
        ok = _call(device, "merge_dense", _native_list(dst, idx, dd),
                   _native_list(delta, idx, ed), float(weight)) and ok
    return ok


def _groups_by_pair(a: list, b: list) -> dict:
    groups: dict = {}
    for i, (x, y) in enumerate(zip(a, b)):
        groups.setdefault((x.dtype, y.dtype), []).append(i)
    return groups


def merge_sparse(dst: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                 weight: float) -> bool:
    """``dst.view(-1)[indices] += weight * values`` (duplicates accumulate).

    An index outside ``[0, dst.numel())`` raises IndexError and a NaN/Inf value
    returns False; in both cases nothing is written.
    """
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"dst is not a tensor (got {type(dst).__name__})")
    device = dst.device
    _check(dst, "dst", device)
    _check(indices, "indices", device, _INDEX_DTYPES)
    _check(values, "values", device)
    if indices.dim() != 1 or values.dim() != 1:
        raise ValueError(f"indices and values must be 1-D, got shapes {tuple(indices.shape)} "
                         f"and {tuple(values.shape)}")
    if indices.numel() != values.numel():
        raise ValueError(f"indices has {indices.numel()} elements but values has "
                         f"{values.numel()}")
    return _call(device, "merge_sparse", _flat(dst), indices.data_ptr(), _CODES[indices.dtype],
                 values.data_ptr(), _CODES[values.dtype], indices.numel(), float(weight))


def weighted_sum(out: TensorOrList, inputs: Sequence[TensorOrList],
                 weights: Sequence[float]) -> TensorOrList:
    """``out = sum_k weights[k] * inputs[k]``; ``inputs`` is K tensors or K lists shaped like out."""
    outs = _as_list(out, "out")
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list, got {type(inputs).__name__}")
    ins = [_as_list(x, f"inputs[{k}]") for k, x in enumerate(inputs)]
    weights = [float(w) for w in weights]
    if len(weights) != len(ins):
        raise ValueError(f"{len(ins)} inputs but {len(weights)} weights")
    device = _device_of(outs, None, "out")
    for i, o in enumerate(outs):
        _check(o, f"out[{i}]", device)
    for k, x in enumerate(ins):
        _check_pair(outs, x, "out", f"inputs[{k}]", device, same_dtype=False)
    for k, x in enumerate(ins):
        for i, t in enumerate(x):
            if t.dtype != ins[0][i].dtype:
                raise ValueError(f"inputs[{k}][{i}] is {_name(t.dtype)} but inputs[0][{i}] is "
                                 f"{_name(ins[0][i].dtype)}")
    groups: dict = {}
    for i, o in enumerate(outs):
        groups.setdefault((o.dtype, ins[0][i].dtype if ins else o.dtype), []).append(i)
    for (od, idt), idx in groups.items():
        _call(device, "weighted_sum", _native_list(outs, idx, od),
              [_native_list(x, idx, idt) for x in ins], weights)
    return out
