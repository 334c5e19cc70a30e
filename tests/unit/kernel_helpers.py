"""Shared helpers for the ashl.kernels tests: devices, guarded buffers, references, tolerances."""
from __future__ import annotations

from math import prod

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_ID = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
         torch.int32: "i32", torch.int64: "i64"}
_MANT = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_MIN_SUB = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}
EPS32 = 2.0 ** -24  # unit roundoff of fp32

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available")]),
]
SENTINEL = -777.0


def dt_ids(dts):
    return [DT_ID[d] for d in dts]


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def rand(shape, dtype, device, g, offset: int = 0, scale: float = 1.0) -> torch.Tensor:
    """A random tensor; with ``offset`` > 0 it is a view starting ``offset`` elements into a
    bigger storage (so its data pointer is misaligned for anything wider than one element)."""
    shape = tuple(shape)
    n = prod(shape)
    vals = (torch.randn(n, generator=g) * scale).to(dtype)
    base = torch.full((n + offset,), SENTINEL, dtype=dtype, device=device)
    t = base[offset:].view(shape)
    t.copy_(vals.view(shape))
    return t


class Guarded:
    """A flat 1-D buffer of ``n`` elements inside a bigger storage filled with a sentinel, so
    a test can assert that nothing outside ``[0, n)`` (and nothing at all, on error) is written."""

    def __init__(self, n, dtype, device, head: int = 0, tail: int = 5, fill=None, g=None):
        self.base = torch.full((head + n + tail,), SENTINEL, dtype=dtype, device=device)
        self.head, self.n = head, n
        self.flat = self.base[head:head + n + tail]  # the buffer handed to the kernel
        if fill is not None:
            self.flat[:n].copy_(fill.reshape(-1).to(dtype))
        elif g is not None:
            self.flat[:n].copy_(torch.randn(n, generator=g).to(dtype))
        self.before = self.base.clone()

    @property
    def body(self):
        return self.flat[: self.n]

    def assert_margins_untouched(self):
        h, n = self.head, self.n
        assert torch.equal(self.base[:h], self.before[:h]), "wrote before the buffer"
        assert torch.equal(self.base[h + n:], self.before[h + n:]), "wrote past the end"

    def assert_untouched(self):
        assert torch.equal(self.base, self.before), "buffer was written"


def cat32(tensors) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])


def cat64(tensors) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


def ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """Spacing of ``dtype`` values at magnitude |x| (float64 in, float64 out)."""
    x = x.abs()
    _, e = torch.frexp(x)
    u = torch.ldexp(torch.ones_like(x), (e - 1 - _MANT[dtype]).to(torch.int64))
    u = torch.clamp(u, min=_MIN_SUB[dtype])
    return torch.where(x == 0, torch.full_like(x, _MIN_SUB[dtype]), u)


def assert_matches(actual: torch.Tensor, ref32: torch.Tensor, mag: torch.Tensor | None = None,
                   roundings=4.0, ulps=1.0, extra=None, what: str = "result"):
    """Compare ``actual`` (any float dtype, any device) against the fp32 reference ``ref32``
    cast once to ``actual``'s dtype.

    ``mag`` is None for ops that are one rounding of the same fp32 expression: then the match
    must be bit-exact. Otherwise ``mag`` (float64) is the sum of the magnitudes of the terms, and
    the allowed error is ``ulps`` ulp of the output dtype (the final cast may round the other
    way) plus ``roundings`` fp32 roundings of the terms (the kernel may fuse or reorder them)."""
    dtype = actual.dtype
    a = actual.detach().reshape(-1).cpu()
    exp = ref32.reshape(-1).to(dtype)
    assert a.numel() == exp.numel(), f"{what}: {a.numel()} elements, expected {exp.numel()}"
    if mag is None:
        if torch.equal(a, exp):
            return
        bad = (a != exp).nonzero().reshape(-1)
        i = bad[0].item()
        raise AssertionError(
            f"{what} [{DT_ID[dtype]}]: {bad.numel()} of {a.numel()} elements differ (exact "
            f"expected); first at {i}: got {a[i].item()!r}, expected {exp[i].item()!r}")
    a64, e64 = a.double(), exp.double()
    tol = ulps * ulp(torch.maximum(a64.abs(), e64.abs()), dtype) + roundings * EPS32 * mag.reshape(-1)
    if extra is not None:
        tol = tol + extra.reshape(-1)
    err = (a64 - e64).abs()
    ok = err <= tol
    if not bool(ok.all()):
        bad = (~ok).nonzero().reshape(-1)
        i = bad[0].item()
        raise AssertionError(
            f"{what} [{DT_ID[dtype]}]: {bad.numel()} of {a.numel()} elements off; first at {i}: "
            f"got {a[i].item()!r}, expected {exp[i].item()!r} (err {err[i].item():.3g}, "
            f"tol {tol[i].item():.3g})")


def snapshot(tensors):
    return [t.clone() for t in tensors]


def assert_unchanged(tensors, snaps, name):
    for i, (t, s) in enumerate(zip(tensors, snaps)):
        assert torch.equal(t, s), f"{name}[{i}] was modified"


def random_shapes(g: torch.Generator, count: int, max_numel: int = 3000):
    """``count`` random shapes of 0-4 dims (some empty, some scalar-like)."""
    shapes = []
    for _ in range(count):
        ndim = int(torch.randint(0, 5, (1,), generator=g))
        if ndim == 0:
            shapes.append(())
            continue
        dims = []
        budget = max_numel
        for _ in range(ndim):
            d = int(torch.randint(0, max(2, min(budget, 64) + 1), (1,), generator=g))
            if torch.rand(1, generator=g).item() < 0.03:
                d = 0
            dims.append(d)
            budget = max(1, budget // max(d, 1))
        shapes.append(tuple(dims))
    return shapes
