"""ashl.kernels rejects bad arguments with an error that names the offending tensor, and writes
nothing when it does (every test snapshots all the tensors it passes and compares afterwards).

The offending tensor sits late in its list on purpose: a kernel that validated lazily, tensor
by tensor, would already have written the earlier ones.
"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_helpers import HAS_CUDA, gen, rand  # noqa: E402

import ashl.kernels as K  # noqa: E402

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
SHAPES = [(10,), (4, 6), (7,), (3, 3), (5,)]
TOTAL = sum(torch.Size(s).numel() for s in SHAPES)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDA is not available")


def names(pattern):
    """A regex matching the offending name literally (``anchors[3]`` is not a char class)."""
    return re.escape(pattern)


class Call:
    """Valid arguments for every kernel; a test breaks one and checks the error."""

    def __init__(self, dtype=f32):
        g = gen(0)
        self.params = [rand(s, dtype, "cpu", g) for s in SHAPES]
        self.anchors = [rand(s, dtype, "cpu", g) for s in SHAPES]
        self.residuals = [rand(s, dtype, "cpu", g) for s in SHAPES]
        self.out = torch.full((TOTAL,), -777.0)
        self.flat = torch.randn(TOTAL, generator=g)
        self.dst = [rand(s, dtype, "cpu", g) for s in SHAPES]
        self.delta = [rand(s, dtype, "cpu", g) for s in SHAPES]
        self.sdst = torch.randn(100, generator=g)
        self.indices = torch.randperm(100, generator=g)[:20].to(torch.int32)
        self.values = torch.randn(20, generator=g)
        self.inputs = [[rand(s, dtype, "cpu", g) for s in SHAPES] for _ in range(3)]
        self.weights = [0.5, 0.25, 0.25]

    def _all(self):
        ts = [t for t in (self.out, self.flat, self.sdst, self.indices, self.values)
              if isinstance(t, torch.Tensor)]
        for lst in (self.params, self.anchors, self.residuals, self.dst, self.delta,
                    *self.inputs):
            ts += [t for t in lst if isinstance(t, torch.Tensor)]
        return ts

    def snapshot(self):
        self._tensors = self._all()
        self._snaps = [t.clone() if t.device.type != "meta" else None for t in self._tensors]

    def assert_nothing_written(self):
        for t, s in zip(self._tensors, self._snaps):
            if s is not None:
                assert torch.equal(t, s), "a tensor was written although the call failed"


def expect(exc, match, fn, c: Call):
    c.snapshot()
    with pytest.raises(exc, match=match):
        fn()
    c.assert_nothing_written()


def noncontig(shape, dtype=f32):
    """A non-contiguous tensor of ``shape`` (every other element of a bigger one)."""
    n = torch.Size(shape).numel()
    return torch.randn(2 * n).to(dtype)[::2].view(shape) if len(shape) == 1 else \
        torch.randn(*reversed(shape)).to(dtype).t()


# --------------------------------------------------------------------------------------------
# pack_delta / unpack_assign / unpack_add share the (params, anchors, flat) validation

def run_pack(c):
    return K.pack_delta(c.params, c.anchors, c.out, 0.5, c.residuals)


def run_assign(c):
    return K.unpack_assign(c.params, c.anchors, c.flat)


def run_add(c):
    return K.unpack_add(c.params, c.anchors, c.flat)


RUNNERS = {"pack_delta": (run_pack, "out"), "unpack_assign": (run_assign, "flat"),
           "unpack_add": (run_add, "flat")}
OPS = list(RUNNERS)


@pytest.mark.parametrize("op", OPS)
def test_anchor_dtype_mismatch(op):
    c = Call()
    c.anchors[3] = c.anchors[3].to(f16)
    expect(ValueError, names("anchors[3]"), lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_anchor_size_mismatch(op):
    c = Call()
    c.anchors[3] = torch.randn(10)
    expect(ValueError, names("anchors[3]"), lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("first,second", [("size", "noncontig"), ("dtype", "size"),
                                          ("noncontig", "dtype")])
def test_the_first_bad_anchor_is_named(op, first, second):
    """Two faults in one list: the error names the earlier tensor, whatever its fault (the
    list is checked attribute by attribute first, then walked in order to find it)."""
    c = Call()
    faults = {"size": lambda i: torch.randn(11),
              "dtype": lambda i: c.anchors[i].to(f16),
              "noncontig": lambda i: noncontig(SHAPES[i])}
    c.anchors[1] = faults[first](1)
    c.anchors[3] = faults[second](3)
    expect(ValueError, names("anchors[1]"), lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_parameters_pass(op):
    c = Call()
    c.params = [torch.nn.Parameter(p) for p in c.params]
    RUNNERS[op][0](c)


@pytest.mark.parametrize("op", OPS)
def test_anchor_list_too_short(op):
    c = Call()
    c.anchors = c.anchors[:-1]
    expect(ValueError, "anchors", lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_anchor_list_too_long(op):
    c = Call()
    c.anchors = c.anchors + [torch.randn(3)]
    expect(ValueError, "anchors", lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("which", ["params", "anchors"])
def test_non_contiguous(op, which):
    c = Call()
    getattr(c, which)[3] = noncontig((3, 3))
    expect(ValueError, names(f"{which}[3]"), lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64, torch.uint8,
                                   torch.bool, torch.complex64],
                         ids=["i32", "i64", "f64", "u8", "bool", "c64"])
def test_unsupported_param_dtype(op, dtype):
    c = Call()
    c.params[4] = c.params[4].to(dtype)
    c.anchors[4] = c.anchors[4].to(dtype)
    c.residuals[4] = c.residuals[4].to(dtype)
    expect(ValueError, names("params[4]"), lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.float64], ids=["i32", "f64"])
def test_unsupported_flat_dtype(op, dtype):
    c = Call()
    c.out, c.flat = c.out.to(dtype), c.flat.to(dtype)
    expect(ValueError, RUNNERS[op][1], lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_flat_too_small(op):
    c = Call()
    c.out, c.flat = c.out[:-1], c.flat[:-1]
    expect(ValueError, RUNNERS[op][1], lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_flat_non_contiguous(op):
    c = Call()
    c.out, c.flat = noncontig((TOTAL,)), noncontig((TOTAL,))
    expect(ValueError, RUNNERS[op][1], lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_param_not_a_tensor(op):
    c = Call()
    c.params[2] = [1.0, 2.0]
    expect(TypeError, names("params[2]"), lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_anchor_not_a_tensor(op):
    c = Call()
    c.anchors[4] = 3.0
    expect(TypeError, names("anchors[4]"), lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_flat_not_a_tensor(op):
    c = Call()
    c.out = c.flat = [0.0] * TOTAL
    expect(TypeError, RUNNERS[op][1], lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_meta_device_param(op):
    """A tensor on another device (meta: no CUDA needed) is refused, not dereferenced."""
    c = Call()
    c.params[3] = torch.empty(3, 3, device="meta")
    c.anchors[3] = torch.empty(3, 3, device="meta")
    c.residuals[3] = torch.empty(3, 3, device="meta")
    expect(ValueError, names("params[3]"), lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_meta_device_flat(op):
    c = Call()
    c.out = c.flat = torch.empty(TOTAL, device="meta")
    expect(ValueError, RUNNERS[op][1], lambda: RUNNERS[op][0](c), c)


@pytest.mark.parametrize("op", OPS)
def test_all_on_meta_refused(op):
    """Everything on an unsupported device: a clear error, no null-pointer dereference."""
    c = Call()
    meta = lambda ts: [torch.empty(t.shape, device="meta") for t in ts]  # noqa: E731
    c.params, c.anchors, c.residuals = meta(c.params), meta(c.anchors), meta(c.residuals)
    c.out = c.flat = torch.empty(TOTAL, device="meta")
    expect(ValueError, "meta", lambda: RUNNERS[op][0](c), c)


@needs_cuda
@pytest.mark.parametrize("op", OPS)
def test_mixed_devices(op):
    c = Call()
    c.anchors[2] = c.anchors[2].cuda()
    expect(ValueError, names("anchors[2]"), lambda: RUNNERS[op][0](c), c)
    c = Call()
    c.out = c.out.cuda()
    c.flat = c.flat.cuda()
    expect(ValueError, RUNNERS[op][1], lambda: RUNNERS[op][0](c), c)


def test_residual_dtype_mismatch():
    c = Call()
    c.residuals[4] = c.residuals[4].to(bf16)
    expect(ValueError, names("residuals[4]"), lambda: run_pack(c), c)


def test_residual_size_mismatch():
    c = Call()
    c.residuals[2] = torch.randn(8)
    expect(ValueError, names("residuals[2]"), lambda: run_pack(c), c)


def test_residual_list_length():
    c = Call()
    c.residuals = c.residuals[:3]
    expect(ValueError, "residuals", lambda: run_pack(c), c)


def test_residual_non_contiguous():
    c = Call()
    c.residuals[1] = noncontig((4, 6))
    expect(ValueError, names("residuals[1]"), lambda: run_pack(c), c)


def test_residual_not_a_tensor():
    c = Call()
    c.residuals[3] = None
    expect(TypeError, names("residuals[3]"), lambda: run_pack(c), c)


def test_params_not_a_list():
    c = Call()
    expect(TypeError, "params", lambda: K.pack_delta(42, c.anchors, c.out), c)


# --------------------------------------------------------------------------------------------
# merge_dense

def run_merge(c):
    return K.merge_dense(c.dst, c.delta, 0.5)


def test_merge_dense_size_mismatch():
    c = Call()
    c.delta[4] = torch.randn(6)
    expect(ValueError, names("delta[4]"), lambda: run_merge(c), c)


def test_merge_dense_list_length():
    c = Call()
    c.delta = c.delta[:-2]
    expect(ValueError, "delta", lambda: run_merge(c), c)


@pytest.mark.parametrize("which", ["dst", "delta"])
def test_merge_dense_non_contiguous(which):
    c = Call()
    getattr(c, which)[3] = noncontig((3, 3))
    expect(ValueError, names(f"{which}[3]"), lambda: run_merge(c), c)


@pytest.mark.parametrize("which", ["dst", "delta"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float64], ids=["i32", "f64"])
def test_merge_dense_bad_dtype(which, dtype):
    c = Call()
    getattr(c, which)[4] = getattr(c, which)[4].to(dtype)
    expect(ValueError, names(f"{which}[4]"), lambda: run_merge(c), c)


@pytest.mark.parametrize("which", ["dst", "delta"])
def test_merge_dense_not_a_tensor(which):
    c = Call()
    getattr(c, which)[2] = "x"
    expect(TypeError, names(f"{which}[2]"), lambda: run_merge(c), c)


def test_merge_dense_meta_device():
    c = Call()
    c.delta[3] = torch.empty(3, 3, device="meta")
    expect(ValueError, names("delta[3]"), lambda: run_merge(c), c)


@needs_cuda
def test_merge_dense_mixed_devices():
    c = Call()
    c.delta[3] = c.delta[3].cuda()
    expect(ValueError, names("delta[3]"), lambda: run_merge(c), c)


# --------------------------------------------------------------------------------------------
# merge_sparse

def run_sparse(c):
    return K.merge_sparse(c.sdst, c.indices, c.values, 0.5)


@pytest.mark.parametrize("idt", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("bad", [100, 101, -1, -100, 2 ** 31 - 1])
@pytest.mark.parametrize("pos", [0, 10, 19])
def test_merge_sparse_out_of_range(idt, bad, pos):
    c = Call()
    c.indices = c.indices.to(idt)
    c.indices[pos] = bad
    expect(IndexError, re.escape(str(bad)), lambda: run_sparse(c), c)


def test_merge_sparse_out_of_range_int64_beyond_int32():
    c = Call()
    c.indices = c.indices.to(torch.int64)
    c.indices[-1] = 2 ** 40 + 5
    expect(IndexError, str(2 ** 40 + 5), lambda: run_sparse(c), c)


def test_merge_sparse_out_of_range_after_many_valid():
    """The bad index is the last of 300k: the valid ones before it must not land."""
    g = gen(1)
    c = Call()
    c.sdst = torch.randn(1_000_000, generator=g)
    c.indices = torch.randint(0, 1_000_000, (300_000,), generator=g)
    c.indices[-1] = 1_000_000
    c.values = torch.randn(300_000, generator=g)
    expect(IndexError, "1000000", lambda: run_sparse(c), c)


@pytest.mark.parametrize("dtype", [f32, f16, torch.uint8, torch.int16, torch.bool],
                         ids=["f32", "f16", "u8", "i16", "bool"])
def test_merge_sparse_bad_index_dtype(dtype):
    c = Call()
    c.indices = c.indices.to(dtype)
    expect(ValueError, "indices", lambda: run_sparse(c), c)


def test_merge_sparse_indices_2d():
    c = Call()
    c.indices = c.indices.view(4, 5)
    c.values = c.values.view(4, 5)
    expect(ValueError, "indices", lambda: run_sparse(c), c)


def test_merge_sparse_values_2d():
    c = Call()
    c.values = c.values.view(4, 5)
    expect(ValueError, "values", lambda: run_sparse(c), c)


@pytest.mark.parametrize("n", [19, 21, 0])
def test_merge_sparse_length_mismatch(n):
    c = Call()
    c.values = torch.randn(n)
    expect(ValueError, "values", lambda: run_sparse(c), c)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=["f64", "i32"])
def test_merge_sparse_bad_values_dtype(dtype):
    c = Call()
    c.values = c.values.to(dtype)
    expect(ValueError, "values", lambda: run_sparse(c), c)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=["f64", "i32"])
def test_merge_sparse_bad_dst_dtype(dtype):
    c = Call()
    c.sdst = c.sdst.to(dtype)
    expect(ValueError, "dst", lambda: run_sparse(c), c)


@pytest.mark.parametrize("which", ["sdst", "indices", "values"])
def test_merge_sparse_non_contiguous(which):
    c = Call()
    t = getattr(c, which)
    nc = torch.zeros(2 * t.numel(), dtype=t.dtype)[::2]
    nc.copy_(t)
    if which == "sdst":
        nc = torch.randn(10, 20).t()
    setattr(c, which, nc)
    expect(ValueError, "dst" if which == "sdst" else which, lambda: run_sparse(c), c)


@pytest.mark.parametrize("which", ["sdst", "indices", "values"])
def test_merge_sparse_not_a_tensor(which):
    c = Call()
    setattr(c, which, [1, 2, 3])
    expect(TypeError, "dst" if which == "sdst" else which, lambda: run_sparse(c), c)


@pytest.mark.parametrize("which", ["indices", "values"])
def test_merge_sparse_meta_device(which):
    c = Call()
    setattr(c, which, torch.empty(20, dtype=getattr(c, which).dtype, device="meta"))
    expect(ValueError, which, lambda: run_sparse(c), c)


@needs_cuda
@pytest.mark.parametrize("which", ["indices", "values"])
def test_merge_sparse_mixed_devices(which):
    c = Call()
    setattr(c, which, getattr(c, which).cuda())
    expect(ValueError, which, lambda: run_sparse(c), c)


# --------------------------------------------------------------------------------------------
# weighted_sum

def run_ws(c):
    return K.weighted_sum(c.dst, c.inputs, c.weights)


def test_weighted_sum_weights_length():
    c = Call()
    c.weights = [0.5, 0.5]
    expect(ValueError, "weights", lambda: run_ws(c), c)


def test_weighted_sum_input_list_length():
    c = Call()
    c.inputs[1] = c.inputs[1][:-1]
    expect(ValueError, names("inputs[1]"), lambda: run_ws(c), c)


def test_weighted_sum_input_size_mismatch():
    c = Call()
    c.inputs[2][3] = torch.randn(8)
    expect(ValueError, names("inputs[2][3]"), lambda: run_ws(c), c)


def test_weighted_sum_input_non_contiguous():
    c = Call()
    c.inputs[2][1] = noncontig((4, 6))
    expect(ValueError, names("inputs[2][1]"), lambda: run_ws(c), c)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64], ids=["f64", "i64"])
def test_weighted_sum_input_bad_dtype(dtype):
    c = Call()
    c.inputs[1][4] = c.inputs[1][4].to(dtype)
    expect(ValueError, names("inputs[1][4]"), lambda: run_ws(c), c)


def test_weighted_sum_inputs_of_different_dtypes():
    """The K inputs of one tensor share a dtype (out's dtype is free): a clear error otherwise."""
    c = Call()
    c.inputs[2][4] = c.inputs[2][4].to(f16)
    expect(ValueError, names("inputs[2][4]"), lambda: run_ws(c), c)


def test_weighted_sum_out_non_contiguous():
    c = Call()
    c.dst[3] = noncontig((3, 3))
    expect(ValueError, names("out[3]"), lambda: run_ws(c), c)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=["f64", "i32"])
def test_weighted_sum_out_bad_dtype(dtype):
    c = Call()
    c.dst[4] = c.dst[4].to(dtype)
    expect(ValueError, names("out[4]"), lambda: run_ws(c), c)


def test_weighted_sum_single_out_input_size_mismatch():
    c = Call()
    expect(ValueError, names("inputs[1]"),
           lambda: K.weighted_sum(c.dst[0], [c.inputs[0][0], c.inputs[0][1]], [1.0, 1.0]), c)


def test_weighted_sum_input_not_a_tensor():
    c = Call()
    c.inputs[1][2] = 1.5
    expect(TypeError, names("inputs[1][2]"), lambda: run_ws(c), c)


def test_weighted_sum_meta_device():
    c = Call()
    c.inputs[0][4] = torch.empty(5, device="meta")
    expect(ValueError, names("inputs[0][4]"), lambda: run_ws(c), c)


# --------------------------------------------------------------------------------------------
# non-finite scale / weights are refused up front (a NaN weight would poison the model)

BAD_SCALARS = [float("nan"), float("inf"), float("-inf"), 1e39]  # 1e39 overflows fp32


@pytest.mark.parametrize("bad", BAD_SCALARS, ids=["nan", "inf", "-inf", "1e39"])
def test_non_finite_scale_and_weights(bad):
    c = Call()
    expect(ValueError, "scale",
           lambda: K.pack_delta(c.params, c.anchors, c.out, bad, c.residuals), c)
    expect(ValueError, "weight", lambda: K.merge_dense(c.dst, c.delta, bad), c)
    expect(ValueError, "weight", lambda: K.merge_sparse(c.sdst, c.indices, c.values, bad), c)
    expect(ValueError, names("weights[2]"),
           lambda: K.weighted_sum(c.dst, c.inputs, [0.5, 0.5, bad]), c)
