"""Validated entry points to ashl's fused multi-tensor kernels (``ashl._C``).

Every function takes whole tensor lists (a model's parameters) and runs one
native call per dtype group, on CPU (OpenMP + SIMD) or CUDA (one launch for
many tensors). Tensors are checked here, with errors that name the offending
tensor, before any memory is touched; the native code checks bounds again.

Flat layout: tensor ``i`` of a list occupies ``flat[off_i : off_i + numel_i]``
with ``off_i`` the sum of the previous numels (back to back, list order).
"""
from __future__ import annotations

import itertools
import operator
import threading
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
    "num_threads", "FlatTensors", "clone_tensors", "flat_forms", "views_like",
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
    return _offsets([t.numel() for t in _as_list(tensors, "tensors")])


def _offsets(numels: list[int]) -> list[int]:
    """Each tensor's start in the flat layout."""
    return [0, *itertools.accumulate(numels)][:len(numels)]


# --- tensors stored flat --------------------------------------------------------

class FlatTensors(tuple):
    """Tensors that are back-to-back views of one contiguous buffer, ``flat``, in order.

    The kernels take such a list as the one tensor it covers: the flat layout is the same, and
    a call costs what one tensor costs, however many the model has (checking and walking a
    transformer's hundreds of small tensors was most of a commit's kernel time on one of 3.5M
    elements). Made by ``FlatTensors.of`` (views found to be stored so) and ``clone`` only;
    a tuple, so nothing can swap a view out of it."""

    flat: torch.Tensor
    numels: tuple   # each view's, so that two lists pair only when laid out alike

    def __new__(cls, views, flat: torch.Tensor, numels: tuple | None = None):
        self = super().__new__(cls, views)
        self.flat = flat
        self.numels = tuple(t.numel() for t in views) if numels is None else numels
        return self

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> "FlatTensors | None":
        """``tensors`` as FlatTensors if they are contiguous, of one dtype and device, and
        laid back to back in one storage in list order; else None."""
        tensors = list(tensors)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            return None
        first = tensors[0]
        storage = first.untyped_storage().data_ptr()
        at = first.storage_offset()
        for t in tensors:
            if (t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                    or t.untyped_storage().data_ptr() != storage or t.storage_offset() != at):
                return None
            at += t.numel()
        flat = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                       (at - first.storage_offset(),))
        return cls(tensors, flat)

    def __reduce__(self):   # copy, deepcopy, pickle: the views and their buffer together
        return FlatTensors, (tuple(self), self.flat, self.numels)

    def clone(self) -> "FlatTensors":
        """A copy in a new flat buffer, viewed the same way."""
        flat = self.flat.clone()
        return FlatTensors(views_like(flat, self), flat, self.numels)


def views_like(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like``'s tensors, back to back in list order."""
    out, off = [], 0
    for t in like:
        out.append(flat[off:off + t.numel()].view(t.shape))
        off += t.numel()
    return out


def clone_tensors(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Detached copies of ``tensors``, stored flat (FlatTensors) when they are."""
    if isinstance(tensors, FlatTensors):
        return tensors.clone()
    return [t.detach().clone() for t in tensors]


def flat_forms(*lists):
    """The lists as the one-tensor lists of their flat buffers when every one given (None
    aside) is FlatTensors laid out alike; else as they are (then checked tensor by tensor)."""
    given = [x for x in lists if x is not None]
    if given and all(isinstance(x, FlatTensors) and x.numels == given[0].numels
                     for x in given):
        return tuple(None if x is None else [x.flat] for x in lists)
    return lists


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


class _Scan:
    """A tensor list as the native calls take it: data pointers, numels, dtypes. Built by
    ``_scan`` and ``_scan_like``, which check it first."""

    __slots__ = ("name", "ptrs", "numels", "dtypes")

    def __init__(self, tensors: list, name: str):
        self.name = name
        # map over the unbound methods: a fifth cheaper than comprehensions
        self.ptrs = list(map(torch.Tensor.data_ptr, tensors))
        self.numels = list(map(torch.Tensor.numel, tensors))
        self.dtypes = list(map(_dtype_of, tensors))

    def total(self) -> int:
        return sum(self.numels)

    def offsets(self) -> list[int]:
        return _offsets(self.numels)

    def native(self, idx: list[int], dtype) -> "_C.TensorList":
        """The tensors at ``idx`` (all of one dtype) as a native list."""
        if len(idx) == len(self.ptrs):
            return _C.TensorList(_CODES[dtype], self.ptrs, self.numels)
        return _C.TensorList(_CODES[dtype], [self.ptrs[i] for i in idx],
                             [self.numels[i] for i in idx])


# The checks of a list run attribute by attribute over the whole list (map, in C), and only a
# list that fails is walked tensor by tensor to name the first bad tensor, with the same checks
# in the same order as one tensor at a time: this Python cost is paid per tensor on every call,
# and a transformer has hundreds of small ones (checking each tensor in turn cost 2.8 us per
# tensor and call, 0.55 ms on 196).

_dtype_of = operator.attrgetter("dtype")
_is_cpu = operator.attrgetter("is_cpu")
_device = operator.attrgetter("device")


def _all_valid(tensors: list, device: torch.device, dtypes) -> bool:
    """True if every element is a contiguous tensor on ``device`` of one of ``dtypes``: what
    ``_check`` asks of each."""
    if not all(map(isinstance, tensors, itertools.repeat(torch.Tensor))):
        return False
    if device.type == "cpu":
        on_device = all(map(_is_cpu, tensors))  # cheaper than building each t.device
    else:
        on_device = set(map(_device, tensors)) <= {device}
    return (on_device and set(map(_dtype_of, tensors)) <= set(dtypes)
            and all(map(torch.Tensor.is_contiguous, tensors)))


def _scan(tensors: list, name: str, device: torch.device, dtypes=_FLOATS) -> _Scan:
    """``tensors`` checked (``_check`` names the first bad one) and scanned."""
    if not _all_valid(tensors, device, dtypes):
        for i, t in enumerate(tensors):
            _check(t, f"{name}[{i}]", device, dtypes)
    return _Scan(tensors, name)


def _scan_like(ref: _Scan, other: list, name: str, device, same_dtype: bool) -> _Scan:
    """``other`` checked and scanned, shaped tensor by tensor like ``ref`` (and of its dtypes
    with ``same_dtype``)."""
    if len(other) != len(ref.numels):
        raise ValueError(f"{name} has {len(other)} tensors but {ref.name} has {len(ref.numels)}")
    if _all_valid(other, device, _FLOATS):
        scan = _Scan(other, name)
        if scan.numels == ref.numels and (not same_dtype or scan.dtypes == ref.dtypes):
            return scan
    for i, t in enumerate(other):
        _check(t, f"{name}[{i}]", device)
        if t.numel() != ref.numels[i]:
            raise ValueError(f"{name}[{i}] has {t.numel()} elements but "
                             f"{ref.name}[{i}] has {ref.numels[i]}")
        if same_dtype and t.dtype != ref.dtypes[i]:
            raise ValueError(f"{name}[{i}] is {_name(t.dtype)} but "
                             f"{ref.name}[{i}] is {_name(ref.dtypes[i])}")
    return _Scan(other, name)


def _first_difference(a: list, b: list) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


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

def _flat(t: torch.Tensor) -> "_C.Flat":
    return _C.Flat(t.data_ptr(), _CODES[t.dtype], t.numel())


def _groups(*dtypes: list) -> dict:
    """Indices of the tensors of each dtype (of each combination of dtypes, one per list):
    almost always a single group."""
    groups: dict = {}
    for i, key in enumerate(zip(*dtypes)):
        groups.setdefault(key, []).append(i)
    return groups


# The CUDA kernels' 4 int32 flags, one buffer per thread and stream: the native call zeroes,
# sets and reads them back in stream order, so a buffer shared with another thread (the
# server's merges beside training) could be cleared between its check and merge kernels.
_scratch = threading.local()


def _cuda_args(device: torch.device) -> tuple[int, int]:
    """(stream, scratch) for a CUDA call: the current stream and this thread's flags for it."""
    stream = torch.cuda.current_stream(device).cuda_stream
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    scratch = buffers.get((device, stream))
    if scratch is None:
        scratch = buffers[(device, stream)] = torch.zeros(4, dtype=torch.int32, device=device)
    return stream, scratch.data_ptr()


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
    params, anchors, residuals = flat_forms(params, anchors, residuals)
    params, anchors = _as_list(params, "params"), _as_list(anchors, "anchors")
    res = None if residuals is None else _as_list(residuals, "residuals")
    device = _device_of(params, out, "params")
    p = _scan(params, "params", device)
    a = _scan_like(p, anchors, "anchors", device, same_dtype=True)
    r = None if res is None else _scan_like(p, res, "residuals", device, same_dtype=True)
    _check_flat(out, "out", device, p.total())
    offsets = p.offsets()
    for (dtype,), idx in _groups(p.dtypes).items():
        _call(device, "pack_delta", p.native(idx, dtype), a.native(idx, dtype),
              None if r is None else r.native(idx, dtype),
              [offsets[i] for i in idx], _flat(out), float(scale))
    return out


def _unpack(op: str, params, anchors, flat) -> None:
    params, anchors = flat_forms(params, anchors)
    params, anchors = _as_list(params, "params"), _as_list(anchors, "anchors")
    device = _device_of(params, flat, "params")
    p = _scan(params, "params", device)
    a = _scan_like(p, anchors, "anchors", device, same_dtype=True)
    _check_flat(flat, "flat", device, p.total())
    offsets = p.offsets()
    for (dtype,), idx in _groups(p.dtypes).items():
        _call(device, op, p.native(idx, dtype), a.native(idx, dtype),
              [offsets[i] for i in idx], _flat(flat))


def unpack_assign(params: TensorOrList, anchors: TensorOrList, flat: torch.Tensor) -> None:
    """``p = a = flat[slice]`` for every tensor."""
    _unpack("unpack_assign", params, anchors, flat)


def unpack_add(params: TensorOrList, anchors: TensorOrList, flat: torch.Tensor) -> None:
    """``a += flat[slice]; p = a`` for every tensor."""
    _unpack("unpack_add", params, anchors, flat)


def merge_dense(dst: TensorOrList, delta: TensorOrList, weight: float,
                out: TensorOrList | None = None) -> bool:
    """``dst += weight * delta``; if ``delta`` holds any NaN/Inf, writes nothing, returns False.

    With ``out`` (tensors shaped and typed like ``dst``, sharing no byte with it):
    ``out = dst + weight * delta`` and ``dst`` is only read, on the CPU in one pass over the
    operands instead of a check pass and a merge pass (CUDA still runs both); on False
    ``out`` holds garbage."""
    dst, delta, out = flat_forms(dst, delta, out)
    dst, delta = _as_list(dst, "dst"), _as_list(delta, "delta")
    device = _device_of(dst, None, "dst")
    d = _scan(dst, "dst", device)
    e = _scan_like(d, delta, "delta", device, same_dtype=False)
    o = None if out is None else _scan_like(d, _as_list(out, "out"), "out", device,
                                            same_dtype=True)
    groups = _groups(d.dtypes, e.dtypes)
    if len(groups) > 1:
        # All-or-nothing across dtype groups: check every delta before merging any.
        if not all(bool(torch.isfinite(t).all()) for t in delta):
            return False
    ok = True
    for (dd, ed), idx in groups.items():
        ok = _call(device, "merge_dense", d.native(idx, dd), e.native(idx, ed),
                   float(weight), None if o is None else o.native(idx, dd)) and ok
    return ok


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
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list, got {type(inputs).__name__}")
    flat_out, *flat_inputs = flat_forms(out, *inputs)
    if flat_out is not out:   # every list stored flat: run on the buffers, return `out`
        weighted_sum(flat_out, flat_inputs, weights)
        return out
    outs = _as_list(out, "out")
    ins = [_as_list(x, f"inputs[{k}]") for k, x in enumerate(inputs)]
    weights = [float(w) for w in weights]
    if len(weights) != len(ins):
        raise ValueError(f"{len(ins)} inputs but {len(weights)} weights")
    device = _device_of(outs, None, "out")
    o = _scan(outs, "out", device)
    xs = [_scan_like(o, x, f"inputs[{k}]", device, same_dtype=False) for k, x in enumerate(ins)]
    for x in xs[1:]:
        if x.dtypes != xs[0].dtypes:
            i = _first_difference(x.dtypes, xs[0].dtypes)
            raise ValueError(f"{x.name}[{i}] is {_name(x.dtypes[i])} but inputs[0][{i}] is "
                             f"{_name(xs[0].dtypes[i])}")
    for (od, idt), idx in _groups(o.dtypes, xs[0].dtypes if xs else o.dtypes).items():
        _call(device, "weighted_sum", o.native(idx, od), [x.native(idx, idt) for x in xs],
              weights)
    return out
