"""Compression of a commit's flat fp32 delta into a wire payload, and back.

Like horovod.torch's `Compression`, but a compressor works on the whole flat delta of a
commit (one buffer for the model, written by `kernels.pack_delta`) and produces a `Payload`
whose `buffer` is exactly the bytes `protocol.send` puts on the wire:

    Compression.none          dense fp32
    Compression.fp16          dense fp16 (half the bytes; values beyond +-65504 become inf and
                              the server's non-finite guard rejects the delta)
    Compression.topk(ratio)   the k = ceil(ratio * numel) largest |delta|, exact (torch.topk),
                              as int32 indices in ascending order + fp32 values

Error feedback: what a commit does not send is kept in a `Residual` and added to the next
delta. A commit calls one method, `pack`, that folds the residual in while packing the
model's delta (one fused kernel) and leaves `delta - sent` in the residual:

    residual = Residual(params)                                     # once
    payload = compressor.pack(params, anchors, residual, scratch, out)
    protocol.send(comm, server, header_for(payload), payload.buffer)

The dense fp32 compressor packs straight into the wire buffer; the others pack into the
fp32 `scratch` buffer and `compress` from there.

Server side: `Payload.from_message(header, raw).merge_into(global_flat, weight)`.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from . import kernels
from .protocol import INDEX_ITEMSIZE, DType, Header, Kind

__all__ = ["Payload", "Residual", "Compressor", "NoneCompressor", "FP16Compressor",
           "TopKCompressor", "Compression", "check_compression"]


class Payload:
    """A compressed delta: `buffer` (uint8, contiguous) holds exactly the wire bytes.

    Dense: numel values of `dtype`. Sparse: nnz int32 indices (ascending), then nnz values.
    """

    __slots__ = ("kind", "dtype", "numel", "nnz", "buffer")

    def __init__(self, kind: Kind, dtype: DType, numel: int, nnz: int, buffer: torch.Tensor):
        self.kind, self.dtype, self.numel, self.nnz, self.buffer = Kind(kind), DType(dtype), numel, nnz, buffer

    @property
    def sparse(self) -> bool:
        return self.kind == Kind.SPARSE_DELTA

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def values(self) -> torch.Tensor:
        start = self.nnz * INDEX_ITEMSIZE if self.sparse else 0
        return self.buffer[start:].view(self.dtype.torch_dtype)

    @property
    def indices(self) -> torch.Tensor | None:
        return self.buffer[:self.nnz * INDEX_ITEMSIZE].view(torch.int32) if self.sparse else None

    def header_fields(self) -> dict:
        """The protocol.Header fields that describe this payload."""
        return {"kind": self.kind, "dtype": self.dtype, "numel": self.numel,
                "nnz": self.nnz if self.sparse else 0}

    def to_dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The delta as a dense fp32 tensor (unsent entries are 0)."""
        if out is None:
            out = torch.zeros(self.numel, dtype=torch.float32, device=self.buffer.device)
        elif out.numel() != self.numel:
            raise ValueError(f"out has {out.numel()} elements, the payload describes {self.numel}")
        if self.sparse:
            out.zero_()
            out.view(-1).index_copy_(0, self.indices.long(), self.values.to(out.dtype))
        else:
            out.view(-1).copy_(self.values)
        return out

    def merge_into(self, dst: torch.Tensor, weight: float,
                   out: torch.Tensor | None = None) -> bool:
        """``dst += weight * delta`` with the fused kernels; False (and nothing written) if the
        delta holds NaN/Inf. A sparse index outside dst raises IndexError. With ``out`` (dense
        only): ``out = dst + weight * delta`` in one pass, dst only read."""
        if dst.numel() != self.numel:
            raise ValueError(f"dst has {dst.numel()} elements, the payload describes {self.numel}")
        if self.sparse:
            if out is not None:
                raise ValueError("a sparse delta merges in place (out is for dense ones)")
            return kernels.merge_sparse(dst, self.indices, self.values, weight)
        return kernels.merge_dense(dst.view(-1), self.values, weight,
                                   out=None if out is None else out.view(-1))

    def split(self, at: int) -> tuple["Payload", "Payload"]:
        """(elements [0, at), elements [at, numel) renumbered from 0): views of a dense payload;
        copies of a sparse one's entries (its indices ascending, as every compressor sends)."""
        if not 0 <= at <= self.numel:
            raise ValueError(f"split at {at} outside a payload of {self.numel} elements")
        if not self.sparse:
            cut = at * self.dtype.itemsize
            return (Payload(self.kind, self.dtype, at, 0, self.buffer[:cut]),
                    Payload(self.kind, self.dtype, self.numel - at, 0, self.buffer[cut:]))
        idx, val = self.indices, self.values
        k = int(torch.searchsorted(idx, torch.tensor([at], dtype=idx.dtype, device=idx.device)))
        head = torch.cat([idx[:k].contiguous().view(torch.uint8), val[:k].contiguous().view(torch.uint8)])
        tail = torch.cat([(idx[k:] - at).view(torch.uint8), val[k:].contiguous().view(torch.uint8)])
        return (Payload(self.kind, self.dtype, at, k, head),
                Payload(self.kind, self.dtype, self.numel - at, self.nnz - k, tail))

    def check(self) -> bool:
        """What a merge checks, without merging: False if a value is NaN/Inf; IndexError if a
        sparse index is outside the payload's elements."""
        if self.sparse and self.nnz:
            idx = self.indices
            if int(idx.min()) < 0 or int(idx.max()) >= self.numel:
                raise IndexError(f"a sparse index is outside [0, {self.numel})")
        return bool(torch.isfinite(self.values).all())

    @classmethod
    def dense(cls, values: torch.Tensor) -> "Payload":
        """A flat contiguous fp32 tensor as a dense payload, without copying."""
        if values.dtype != torch.float32 or values.dim() != 1 or not values.is_contiguous():
            raise ValueError("a dense payload wraps a flat contiguous fp32 tensor")
        return cls(Kind.DENSE_DELTA, DType.FLOAT32, values.numel(), 0, values.view(torch.uint8))

    @classmethod
    def from_message(cls, header: Header, raw: torch.Tensor) -> "Payload":
        """Wrap a received (validated) delta's payload bytes without copying."""
        if header.kind not in (Kind.DENSE_DELTA, Kind.SPARSE_DELTA):
            raise ValueError(f"{Kind(header.kind).name} is not a delta")
        if raw.numel() != header.payload_nbytes:
            raise ValueError(f"payload has {raw.numel()} bytes, the header says {header.payload_nbytes}")
        return cls(header.kind, header.dtype, header.numel, header.nnz, raw)

    def __repr__(self) -> str:
        return (f"Payload({self.kind.name}, {self.dtype.name}, numel={self.numel}, "
                f"nnz={self.nnz}, nbytes={self.nbytes})")


class Residual:
    """Error feedback memory: the part of past deltas not sent yet, flat fp32.

    `views` are per-parameter views shaped like `params` (for pack_delta's residuals);
    `flat` is the same memory as one 1-D tensor (for the compressor).
    """

    def __init__(self, params: Sequence[torch.Tensor]):
        params = list(params)
        for i, p in enumerate(params):
            if p.dtype != torch.float32:
                raise ValueError(f"params[{i}] is {p.dtype}; error feedback needs fp32 parameters")
        device = params[0].device if params else torch.device("cpu")
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        self.views = kernels.FlatTensors(kernels.views_like(self.flat, params), self.flat)

    def zero_(self) -> "Residual":
        self.flat.zero_()
        return self

    def norm(self) -> float:
        return float(self.flat.norm())


def _byte_buffer(out: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    """`out[:nbytes]` if given (reused across commits), else a new buffer on `device`."""
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError("out must be a contiguous 1-D uint8 tensor")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the delta is on {device}")
    if out.numel() < nbytes:
        raise ValueError(f"out has {out.numel()} bytes, the payload needs {nbytes}")
    return out[:nbytes]


def _check_delta(delta: torch.Tensor) -> torch.Tensor:
    """The delta as a flat view: fp32 and contiguous, on any device (a CUDA model's is
    compressed where it was packed, staging.py)."""
    if not isinstance(delta, torch.Tensor):
        raise TypeError(f"delta must be a tensor, got {type(delta).__name__}")
    if delta.dtype != torch.float32:
        raise ValueError(f"delta must be float32, got {delta.dtype}")
    if not delta.is_contiguous():
        raise ValueError("delta must be contiguous")
    return delta.view(-1)


def _check_residual(residual: "Residual | None", delta: torch.Tensor) -> None:
    if residual is not None and residual.flat.numel() != delta.numel():
        raise ValueError(f"residual has {residual.flat.numel()} elements, delta has {delta.numel()}")


class Compressor:
    """Turns a flat fp32 delta into a Payload; `compress(delta, residual=None, out=None)`.

    `out` is an optional reusable uint8 buffer (at least `max_nbytes(numel)` bytes); the
    payload's buffer is then a view of it. `residual`, when given, receives delta - sent.
    """

    name = "compressor"
    ratio = 1.0   # fraction of the delta's entries sent

    def max_nbytes(self, numel: int) -> int:
        raise NotImplementedError

    def pack(self, params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor],
             residual: Residual | None, scratch: torch.Tensor, out: torch.Tensor) -> Payload:
        """The commit's payload: ``delta = params - anchors (+ residual)`` packed by one fused
        kernel into `scratch` (flat fp32), then compressed into `out`."""
        kernels.pack_delta(params, anchors, scratch,
                           residuals=None if residual is None else residual.views)
        return self.compress(scratch[:kernels.flat_numel(params)], residual, out)

    def compress(self, delta: torch.Tensor, residual: Residual | None = None,
                 out: torch.Tensor | None = None) -> Payload:
        raise NotImplementedError

    @staticmethod
    def decompress(payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        return payload.to_dense(out)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class NoneCompressor(Compressor):
    """Dense fp32: sends everything (the residual, if any, becomes zero)."""

    name = "none"

    def max_nbytes(self, numel: int) -> int:
        return 4 * numel

    def pack(self, params, anchors, residual, scratch, out) -> Payload:
        """Straight into the wire buffer: no scratch pass."""
        numel = kernels.flat_numel(params)
        buf = _byte_buffer(out, 4 * numel, params[0].device if params else torch.device("cpu"))
        kernels.pack_delta(params, anchors, buf.view(torch.float32),
                           residuals=None if residual is None else residual.views)
        if residual is not None:
            residual.zero_()
        return Payload(Kind.DENSE_DELTA, DType.FLOAT32, numel, 0, buf)

    def compress(self, delta, residual=None, out=None) -> Payload:
        delta = _check_delta(delta)
        _check_residual(residual, delta)
        buf = _byte_buffer(out, 4 * delta.numel(), delta.device)
        buf.view(torch.float32).copy_(delta)
        if residual is not None:
            residual.zero_()
        return Payload(Kind.DENSE_DELTA, DType.FLOAT32, delta.numel(), 0, buf)


class FP16Compressor(Compressor):
    """Dense fp16; with a residual, the rounding error is fed back into the next commit."""

    name = "fp16"

    def max_nbytes(self, numel: int) -> int:
        return 2 * numel

    def compress(self, delta, residual=None, out=None) -> Payload:
        delta = _check_delta(delta)
        _check_residual(residual, delta)
        buf = _byte_buffer(out, 2 * delta.numel(), delta.device)
        half = buf.view(torch.float16)
        half.copy_(delta)
        if residual is not None:
            torch.sub(delta, half, out=residual.flat)  # what fp16 rounding lost
        return Payload(Kind.DENSE_DELTA, DType.FLOAT16, delta.numel(), 0, buf)


class TopKCompressor(Compressor):
    """Exact top-k by magnitude, k = ceil(ratio * numel), with error feedback.

    Indices are int32 and sorted ascending: the server's scatter-add then walks the global
    model forward through memory (cache- and prefetch-friendly) and duplicates are
    impossible. When k == numel (ratio 1.0) the payload is dense fp32: same content, half the
    bytes. With `dense_when_cheaper` (default), any k whose sparse form (8 bytes per entry)
    would be no smaller than dense (4 bytes per entry) is also sent dense; that sends more
    than top-k, never less, and leaves no residual.
    """

    def __init__(self, ratio: float, dense_when_cheaper: bool = True):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) \
                or not 0.0 < ratio <= 1.0:
            raise ValueError(f"top-k ratio must be a number in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self.dense_when_cheaper = bool(dense_when_cheaper)
        self.name = f"topk({self.ratio:g})"

    def __repr__(self) -> str:
        """Exact (equal reprs, equal compressors): the name rounds the ratio."""
        dense = "" if self.dense_when_cheaper else ", dense_when_cheaper=False"
        return f"Compression.topk({self.ratio!r}{dense})"

    def k(self, numel: int) -> int:
        """Entries sent for a delta of `numel` elements (at least 1 when numel > 0)."""
        return min(numel, max(1 if numel else 0, math.ceil(self.ratio * numel)))

    def _dense(self, numel: int, k: int) -> bool:
        return k == numel or (self.dense_when_cheaper and k * (INDEX_ITEMSIZE + 4) >= 4 * numel)

    def max_nbytes(self, numel: int) -> int:
        k = self.k(numel)
        return 4 * numel if self._dense(numel, k) else k * (INDEX_ITEMSIZE + 4)

    def compress(self, delta, residual=None, out=None) -> Payload:
        delta = _check_delta(delta)
        _check_residual(residual, delta)
        n = delta.numel()
        k = self.k(n)
        if self._dense(n, k):
            return NoneCompressor.compress(self, delta, residual, out)
        buf = _byte_buffer(out, k * (INDEX_ITEMSIZE + 4), delta.device)
        idx = torch.topk(delta.abs(), k, sorted=False).indices
        idx = torch.sort(idx).values
        buf[:k * INDEX_ITEMSIZE].view(torch.int32).copy_(idx)
        torch.index_select(delta, 0, idx, out=buf[k * INDEX_ITEMSIZE:].view(torch.float32))
        if residual is not None:
            residual.flat.copy_(delta)
            residual.flat.index_fill_(0, idx, 0.0)  # everything but what was sent
        return Payload(Kind.SPARSE_DELTA, DType.FLOAT32, n, k, buf)


class Compression:
    """Compression algorithms for commits (`compression=Compression.topk(0.01)`)."""

    none = NoneCompressor()
    fp16 = FP16Compressor()

    @staticmethod
    def topk(ratio: float, dense_when_cheaper: bool = True) -> TopKCompressor:
        return TopKCompressor(ratio, dense_when_cheaper)


def check_compression(compression, strategy: str, accepted: Sequence[str]) -> "Compressor | None":
    """The user's compressor as ashl's, or a ValueError naming it, and what `strategy`
    accepts (kinds "none", "fp16", "topk"). Horovod's ``hvd.Compression.fp16`` is ashl's;
    ``hvd.Compression.none`` is Horovod's default, which its examples pass when no
    compression was asked for: None, the strategy's own choice (the plan's top-k in SHL),
    not a forced dense commit (``ashl.Compression.none`` forces that)."""
    if compression is None:
        return None
    if not isinstance(compression, Compressor):
        name = str(getattr(compression, "__name__", "")).lower()
        if name == "nonecompressor":   # Horovod's default, passed by its examples: no choice
            return None
        if name != "fp16compressor":
            raise ValueError(f"compression={compression!r}: not a compressor ashl knows "
                             "(use ashl.Compression.none, .fp16 or .topk(ratio))")
        compression = Compression.fp16
    kind = "topk" if compression.name.startswith("topk") else compression.name
    if kind not in accepted:
        raise ValueError(f"strategy {strategy!r} cannot send with compression="
                         f"{compression!r} (it takes {', '.join(accepted) or 'none'})")
    return compression
