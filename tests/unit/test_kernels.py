"""ashl.kernels against plain-torch references: every dtype combination, sizes from 0 to
millions, misaligned views, long tensor lists and hypothesis-drawn random lists, under each
fp16/bf16 conversion path of the CPU (AVX-512, F16C, portable: every test runs per path).

The references compute in fp32 from the stored values and cast once at the end, as the kernels
promise. A result must be bit-exact where the op is one rounding of the same fp32 expression
(a difference, a sum with weight 1, a copy); elsewhere the tolerance is one ulp of the output
dtype plus a few fp32 roundings of the terms (see ``assert_matches``).
"""
from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_helpers import (  # noqa: E402
    DEVICES, DTYPES, EPS32, Guarded, assert_matches, assert_unchanged, cat32, cat64, dt_ids, gen,
    rand, random_shapes, snapshot, ulp,
)

import ashl.kernels as K  # noqa: E402

SIZES = [0, 1, 7, 4099]
BIG = 3_000_001
# A list of two BIG tensors is past the CPU kernels' streaming threshold (16 MiB of fp32
# output): the *_large tests run the non-temporal store path, misaligned heads included.
STREAMED = [(BIG,), (BIG // 3, 3)]
DTYPE_PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
PAIR_IDS = [f"{x}-{y}" for x, y in (dt_ids(p) for p in DTYPE_PAIRS)]
HYP = settings(max_examples=40, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True, params=K.supported_cpu_isas())
def cpu_isa(request):
    """Every test once per fp16/bf16 conversion path this CPU has (the portable one always)."""
    K.set_cpu_isa(request.param)
    yield request.param
    K.set_cpu_isa("auto")


def per_tensor(dtype, shapes):
    """One dtype for every tensor, or a list of per-tensor dtypes (mixed-dtype lists)."""
    return list(dtype) if isinstance(dtype, (list, tuple)) else [dtype] * len(shapes)


def shapes_for(n):
    """A three-tensor list around size n: n at both ends so zero-size tensors sit at the ends."""
    return [(n,), (3, 5), (n,)]


# --------------------------------------------------------------------------------------------
# pack_delta


def ref_pack(params, anchors, residuals, scale):
    p, a = cat32(params), cat32(anchors)
    d = p - a
    if scale != 1.0:
        d = d * scale
    if residuals is not None:
        d = d + cat32(residuals)
    if scale == 1.0 and residuals is None:
        return d, None  # one rounding: exact
    mag = abs(scale) * (cat64(params).abs() + cat64(anchors).abs())
    if residuals is not None:
        mag = mag + cat64(residuals).abs()
    return d, mag


def check_pack(device, shapes, pdt, fdt, scale, with_res, seed, offset=0, single=False):
    g = gen(seed)
    pdts = per_tensor(pdt, shapes)
    params = [rand(s, d, device, g, offset) for s, d in zip(shapes, pdts)]
    anchors = [rand(s, d, device, g, offset) for s, d in zip(shapes, pdts)]
    residuals = ([rand(s, d, device, g, offset, 0.1) for s, d in zip(shapes, pdts)]
                 if with_res else None)
    total = sum(p.numel() for p in params)
    out = Guarded(total, fdt, device, head=offset)
    snaps = snapshot(params) + snapshot(anchors)
    kw = {}
    if scale != 1.0:
        kw["scale"] = scale
    if residuals is not None:
        kw["residuals"] = residuals[0] if single else residuals
    if single:
        ret = K.pack_delta(params[0], anchors[0], out.flat, **kw)
    else:
        ret = K.pack_delta(params, anchors, out.flat, **kw)
    assert ret is out.flat
    ref, mag = ref_pack(params, anchors, residuals, scale)
    assert_matches(out.body, ref, mag, what="pack_delta out")
    out.assert_margins_untouched()
    assert_unchanged(params + anchors, snaps, "params/anchors")


PACK_MODES = [(1.0, False), (0.37, False), (-2.5, True), (1.0, True)]
PACK_MODE_IDS = ["plain", "scaled", "scaled+res", "res"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdt,fdt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale,with_res", PACK_MODES, ids=PACK_MODE_IDS)
def test_pack_delta(device, pdt, fdt, n, scale, with_res):
    check_pack(device, shapes_for(n), pdt, fdt, scale, with_res, seed=n + 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdt,fdt,scale,with_res", [
    (f32, f32, 1.0, False), (f32, f32, 0.5, True), (bf16, f16, -2.5, True),
    (f16, f32, 0.37, False)],
    ids=["f32-f32-plain", "f32-f32-res", "bf16-f16-res", "f16-f32-scaled"])
def test_pack_delta_large(device, pdt, fdt, scale, with_res):
    check_pack(device, STREAMED, pdt, fdt, scale, with_res, seed=7, offset=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdt,fdt", [(f32, f32), (f16, f16), (bf16, f32), (f32, bf16)],
                         ids=["f32-f32", "f16-f16", "bf16-f32", "f32-bf16"])
@pytest.mark.parametrize("offset", [1, 3])
def test_pack_delta_misaligned(device, pdt, fdt, offset):
    check_pack(device, [(4099,), (7,), (33, 31), (1,)], pdt, fdt, -2.5, True, seed=11,
               offset=offset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [1, 2, 37, 500])
def test_pack_delta_many_tensors(device, count):
    shapes = random_shapes(gen(count), count)
    check_pack(device, shapes, f32, f32, 1.0, False, seed=count)
    check_pack(device, shapes, bf16, f16, 0.5, True, seed=count + 1, offset=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_res", [False, True])
def test_pack_delta_single_tensor(device, with_res):
    check_pack(device, [(17, 9)], f32, f32, 2.0, with_res, seed=3, single=True)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_delta_empty_list(device):
    out = Guarded(0, f32, device)
    assert K.pack_delta([], [], out.flat) is out.flat
    out.assert_untouched()


@st.composite
def list_case(draw, max_tensors=12):
    shapes = draw(st.lists(
        st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=0,
        max_size=max_tensors))
    big = draw(st.booleans())
    if big and shapes:  # one bigger tensor so chunking/vector paths are hit
        i = draw(st.integers(0, len(shapes) - 1))
        shapes[i] = (draw(st.integers(1000, 70000)),)
    return shapes


dtypes_st = st.sampled_from(DTYPES)


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(shapes=list_case(), pdt=dtypes_st, fdt=dtypes_st,
       scale=st.sampled_from([1.0, 0.0, -1.0, 0.125, 3.7, -1e-3]), with_res=st.booleans(),
       offset=st.integers(0, 3), seed=st.integers(0, 2 ** 31))
def test_pack_delta_hypothesis(device, shapes, pdt, fdt, scale, with_res, offset, seed):
    check_pack(device, shapes, pdt, fdt, scale, with_res, seed, offset)


# --------------------------------------------------------------------------------------------
# unpack_assign / unpack_add


def check_unpack(device, shapes, pdt, fdt, add, seed, offset=0, single=False, anchor_offset=None):
    g = gen(seed)
    pdts = per_tensor(pdt, shapes)
    a_off = offset if anchor_offset is None else anchor_offset
    params = [rand(s, d, device, g, offset) for s, d in zip(shapes, pdts)]
    anchors = [rand(s, d, device, g, a_off) for s, d in zip(shapes, pdts)]
    total = sum(p.numel() for p in params)
    flat = Guarded(total, fdt, device, head=offset, g=g)
    flat_before = flat.base.clone()
    a_before = cat32(anchors)
    fn = K.unpack_add if add else K.unpack_assign
    if single:
        ret = fn(params[0], anchors[0], flat.flat)
    else:
        ret = fn(params, anchors, flat.flat)
    assert ret is None
    f = flat.body.float().cpu()
    if add:
        ref = a_before + f  # one fp32 rounding, then one cast
    else:
        ref = f  # a cast of the stored value
    name = "unpack_add" if add else "unpack_assign"
    assert_list_matches(anchors, ref, what=f"{name} anchors")
    assert_list_matches(params, ref, what=f"{name} params")
    assert torch.equal(flat.base, flat_before), "flat buffer was modified"
    for p, s in zip(params, shapes):
        assert tuple(p.shape) == tuple(s)


def assert_list_matches(tensors, ref32, mag=None, what="result", **kw):
    """assert_matches per tensor (each against its slice of the flat reference, cast to the
    tensor's own dtype), so lists may mix dtypes."""
    assert ref32.numel() == sum(t.numel() for t in tensors)
    if tensors and len({t.dtype for t in tensors}) == 1:  # fast path: one comparison
        actual = torch.cat([t.reshape(-1).cpu() for t in tensors])
        return assert_matches(actual, ref32, mag, what=what, **kw)
    off = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        assert_matches(t, ref32[off:off + n], None if mag is None else mag[off:off + n],
                       what=f"{what}[{i}]", **kw)
        off += n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdt,fdt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("add", [False, True], ids=["assign", "add"])
def test_unpack(device, pdt, fdt, n, add):
    check_unpack(device, shapes_for(n), pdt, fdt, add, seed=n + 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdt,fdt,add", [(f32, f32, False), (f32, f32, True),
                                         (bf16, f32, True), (f16, bf16, False)],
                         ids=["f32-f32-assign", "f32-f32-add", "bf16-f32-add", "f16-bf16-assign"])
def test_unpack_large(device, pdt, fdt, add):
    check_unpack(device, STREAMED + [(7,), (1000, 1000)], pdt, fdt, add, seed=5, offset=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("add", [False, True], ids=["assign", "add"])
def test_unpack_large_outputs_misaligned_apart(device, add):
    # Two outputs on different vector boundaries: one streamed, the other written normally.
    check_unpack(device, STREAMED, f32, f32, add, seed=17, offset=1, anchor_offset=6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pdt,fdt", [(f32, f32), (f16, f16), (bf16, f32)],
                         ids=["f32-f32", "f16-f16", "bf16-f32"])
@pytest.mark.parametrize("offset", [1, 3])
@pytest.mark.parametrize("add", [False, True], ids=["assign", "add"])
def test_unpack_misaligned(device, pdt, fdt, offset, add):
    check_unpack(device, [(4099,), (7,), (33, 31), (1,)], pdt, fdt, add, seed=13, offset=offset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [1, 2, 37, 500])
@pytest.mark.parametrize("add", [False, True], ids=["assign", "add"])
def test_unpack_many_tensors(device, count, add):
    shapes = random_shapes(gen(count + 100), count)
    check_unpack(device, shapes, f32, f32, add, seed=count)
    check_unpack(device, shapes, f16, bf16, add, seed=count + 1, offset=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("add", [False, True], ids=["assign", "add"])
def test_unpack_single_tensor(device, add):
    check_unpack(device, [(5, 4, 3)], bf16, f32, add, seed=4, single=True)


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(shapes=list_case(), pdt=dtypes_st, fdt=dtypes_st, add=st.booleans(),
       offset=st.integers(0, 3), seed=st.integers(0, 2 ** 31))
def test_unpack_hypothesis(device, shapes, pdt, fdt, add, offset, seed):
    check_unpack(device, shapes, pdt, fdt, add, seed, offset)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_roundtrip(device):
    """pack_delta then unpack_add onto the anchors reproduces the params (fp32, exact up to the
    rounding of p - a + a)."""
    g = gen(21)
    shapes = random_shapes(g, 50)
    params = [rand(s, f32, device, g) for s in shapes]
    anchors = [rand(s, f32, device, g) for s in shapes]
    p0 = cat32(params)
    out = torch.empty(K.flat_numel(params), device=device)
    K.pack_delta(params, anchors, out)
    K.unpack_add(params, anchors, out)
    torch.testing.assert_close(cat32(params), p0, rtol=2 * EPS32, atol=1e-6)
    assert torch.equal(cat32(params), cat32(anchors))


# --------------------------------------------------------------------------------------------
# merge_dense


def check_merge_dense(device, shapes, ddt, edt, weight, seed, offset=0, single=False,
                      mode="in_place"):
    """``mode="out"``: the merge into other tensors (misaligned otherwise than dst) leaves dst
    as it was and gives the in-place merge's bits."""
    g = gen(seed)
    dst = [rand(s, d, device, g, offset) for s, d in zip(shapes, per_tensor(ddt, shapes))]
    delta = [rand(s, d, device, g, offset) for s, d in zip(shapes, per_tensor(edt, shapes))]
    d32, e32 = cat32(dst), cat32(delta)
    snaps = snapshot(delta)
    out = None
    if mode == "out":
        out = [rand(s, t.dtype, device, g, (offset + 1) % 4) for s, t in zip(shapes, dst)]
        dst_snaps = snapshot(dst)
    if single:
        ok = K.merge_dense(dst[0], delta[0], weight, out=None if out is None else out[0])
    else:
        ok = K.merge_dense(dst, delta, weight, out=out)
    assert ok is True
    if weight == 1.0:
        ref, mag = d32 + e32, None
    else:
        ref = d32 + e32 * weight
        mag = d32.double().abs() + abs(weight) * e32.double().abs()
    assert_unchanged(delta, snaps, "delta")
    if out is None:
        assert_list_matches(dst, ref, mag, what="merge_dense dst")
        return
    assert_list_matches(out, ref, mag, what="merge_dense out")
    assert_unchanged(dst, dst_snaps, "dst")
    assert K.merge_dense(dst, delta, weight)
    for i, (a, b) in enumerate(zip(dst, out)):
        assert torch.equal(a, b), f"out[{i}] differs from the in-place merge"


MODES = ["in_place", "out"]
WEIGHTS = [1.0, 0.3, -1.7]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ddt,edt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weight", WEIGHTS)
def test_merge_dense(device, ddt, edt, n, weight):
    check_merge_dense(device, shapes_for(n), ddt, edt, weight, seed=n + 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ddt,edt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_merge_dense_into_out(device, ddt, edt, n):
    check_merge_dense(device, shapes_for(n), ddt, edt, WEIGHTS[2], seed=n + 5, mode="out")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ddt,edt,weight", [(f32, f32, 1.0), (f32, f16, 0.25), (bf16, f32, -0.5)],
                         ids=["f32-f32-1", "f32-f16-0.25", "bf16-f32--0.5"])
@pytest.mark.parametrize("mode", MODES)
def test_merge_dense_large(device, ddt, edt, weight, mode):
    check_merge_dense(device, [(BIG,), (3, 1001, 999)], ddt, edt, weight, seed=6, offset=1,
                      mode=mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ddt,edt", [(f32, f32), (f16, f16), (bf16, f16)],
                         ids=["f32-f32", "f16-f16", "bf16-f16"])
@pytest.mark.parametrize("offset", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_merge_dense_misaligned(device, ddt, edt, offset, mode):
    check_merge_dense(device, [(4099,), (7,), (33, 31), (1,)], ddt, edt, 0.3, seed=17,
                      offset=offset, mode=mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [1, 2, 37, 500])
@pytest.mark.parametrize("mode", MODES)
def test_merge_dense_many_tensors(device, count, mode):
    shapes = random_shapes(gen(count + 200), count)
    check_merge_dense(device, shapes, f32, f32, 1.0, seed=count, mode=mode)
    check_merge_dense(device, shapes, bf16, f32, 0.7, seed=count + 1, offset=1, mode=mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_merge_dense_single_tensor(device, mode):
    check_merge_dense(device, [(6, 7)], f16, f32, 0.5, seed=8, single=True, mode=mode)


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(shapes=list_case(), ddt=dtypes_st, edt=dtypes_st,
       weight=st.sampled_from([1.0, 0.0, -1.0, 0.25, 1.0 / 3.0, 7.5]),
       offset=st.integers(0, 3), seed=st.integers(0, 2 ** 31), mode=st.sampled_from(MODES))
def test_merge_dense_hypothesis(device, shapes, ddt, edt, weight, offset, seed, mode):
    check_merge_dense(device, shapes, ddt, edt, weight, seed, offset, mode=mode)


BAD_VALUES = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("edt", DTYPES, ids=dt_ids(DTYPES))
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("weight", [1.0, 0.0])
@pytest.mark.parametrize("mode", MODES)
def test_merge_dense_nonfinite_writes_nothing(device, bad, edt, where, weight, mode):
    g = gen(9)
    shapes = [(10,), (4099,), (3, 3), (1,)]
    dst = [rand(s, f32, device, g) for s in shapes]
    delta = [rand(s, edt, device, g) for s in shapes]
    out = [torch.empty_like(t) for t in dst] if mode == "out" else None
    t, i = {"first": (0, 0), "middle": (1, 2050), "last": (3, 0)}[where]
    delta[t].view(-1)[i] = bad
    snaps = snapshot(dst)
    assert K.merge_dense(dst, delta, weight, out=out) is False
    assert_unchanged(dst, snaps, "dst")


@pytest.mark.parametrize("device", DEVICES)
def test_merge_dense_nan_in_last_of_300_writes_nothing(device):
    g = gen(10)
    shapes = random_shapes(g, 299) + [(64, 65)]
    dst = [rand(s, f32, device, g) for s in shapes]
    delta = [rand(s, f32, device, g) for s in shapes]
    delta[-1].view(-1)[-1] = float("nan")
    snaps = snapshot(dst)
    assert K.merge_dense(dst, delta, 0.5) is False
    assert_unchanged(dst, snaps, "dst")
    # and the same list without the NaN merges
    delta[-1].view(-1)[-1] = 0.0
    assert K.merge_dense(dst, delta, 0.5) is True
    assert not torch.equal(cat32(dst), cat32(snaps))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_merge_dense_inf_at_end_of_large_tensor_writes_nothing(device, mode):
    g = gen(12)
    dst = [rand((BIG,), bf16, device, g)]
    delta = [rand((BIG,), f32, device, g)]
    out = [torch.empty_like(dst[0])] if mode == "out" else None
    delta[0][-1] = float("inf")
    snaps = snapshot(dst)
    assert K.merge_dense(dst, delta, 1.0, out=out) is False
    assert_unchanged(dst, snaps, "dst")


@pytest.mark.parametrize("device", DEVICES)
def test_merge_dense_out_must_not_be_dst(device):
    dst = [torch.ones(5, device=device), torch.ones(3, device=device)]
    delta = [torch.ones(5, device=device), torch.ones(3, device=device)]
    with pytest.raises(ValueError, match=r"out\[1\] overlaps dst\[1\]"):
        K.merge_dense(dst, delta, 1.0, out=[torch.empty(5, device=device), dst[1]])
    # a partial overlap, and out[0] on dst[1]'s bytes: as bad
    base = torch.zeros(12, device=device)
    d2 = [base[0:5], base[5:8]]
    with pytest.raises(ValueError, match=r"out\[0\] overlaps dst\[0\]"):
        K.merge_dense(d2, delta, 1.0, out=[base[3:8], torch.empty(3, device=device)])
    with pytest.raises(ValueError, match=r"out\[1\] overlaps dst\[1\]"):
        K.merge_dense(d2, delta, 1.0, out=[torch.empty(5, device=device), base[6:9]])
    with pytest.raises(ValueError, match=r"out\[0\] overlaps dst\[1\]"):
        K.merge_dense(d2, delta, 1.0, out=[base[5:10], torch.empty(3, device=device)])
    with pytest.raises(ValueError, match=r"out\[0\] has 4 elements"):
        K.merge_dense(dst, delta, 1.0, out=[torch.empty(4, device=device), dst[1]])
    with pytest.raises(ValueError, match=r"out\[0\] is float16"):
        K.merge_dense(dst, delta, 1.0, out=[torch.empty(5, device=device).half(),
                                          torch.empty(3, device=device)])
    assert torch.equal(dst[1], torch.ones(3, device=device))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_merge_dense_guards_hold_for_two_threads_on_two_streams():
    """The server merges on its own stream beside the training thread: each thread's NaN
    flag is its own, so neither clears the other's between its check and its merge."""
    import threading
    n, rounds = 1 << 20, 50
    results = {}

    def merge_rounds(name, poisoned):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dst = torch.zeros(n, device="cuda")
            delta = torch.ones(n, device="cuda")
            if poisoned:
                delta[n // 2] = float("nan")
            oks = [K.merge_dense([dst], [delta], 1.0) for _ in range(rounds)]
            stream.synchronize()
        results[name] = (oks, dst.cpu())

    threads = [threading.Thread(target=merge_rounds, args=("clean", False)),
               threading.Thread(target=merge_rounds, args=("nan", True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clean_oks, clean = results["clean"]
    nan_oks, poisoned = results["nan"]
    assert all(clean_oks) and torch.equal(clean, torch.full((n,), float(rounds)))
    assert not any(nan_oks) and torch.equal(poisoned, torch.zeros(n))


# --------------------------------------------------------------------------------------------
# merge_sparse


def check_merge_sparse(device, numel, ddt, vdt, idt, nnz, dups, weight, seed, offset=0,
                       dst_shape=None, ascending=False):
    g = gen(seed)
    dst = Guarded(numel, ddt, device, head=offset, g=g)
    if dups:
        idx = torch.randint(0, max(numel, 1), (nnz,), generator=g)
        if nnz > 1:
            idx[nnz // 2:] = idx[: nnz - nnz // 2].clone()  # at least half the entries are repeats
    else:
        idx = torch.randperm(numel, generator=g)[:nnz]
    if ascending:
        idx = idx.sort().values
    nnz = idx.numel()
    vals = (torch.randn(nnz, generator=g)).to(vdt)
    base_i = torch.zeros(nnz + offset, dtype=idt, device=device)
    indices = base_i[offset:]
    indices.copy_(idx.to(idt))
    values = torch.zeros(nnz + offset, dtype=vdt, device=device)[offset:]
    values.copy_(vals)
    target = dst.body if dst_shape is None else dst.body.view(dst_shape)
    d32 = dst.body.float().cpu()
    acc = d32.clone()
    v32 = vals.float() * weight
    acc.index_add_(0, idx, v32)
    hits = torch.bincount(idx, minlength=numel).double() if nnz else torch.zeros(numel).double()
    exact = not dups and weight == 1.0
    mag = None
    if not exact:
        mag = d32.double().abs().index_add_(0, idx, v32.double().abs())
    i_before, v_before = indices.clone(), values.clone()
    ok = K.merge_sparse(target, indices, values, weight)
    assert ok is True
    # A kernel may round to the storage dtype after each duplicate: allow one ulp (at the
    # magnitude of the terms) per repeat.
    extra = hits * ulp(mag, ddt) if dups else None
    assert_matches(dst.body, acc, mag, roundings=4.0 + (hits if dups else 0.0), extra=extra,
                   what="merge_sparse dst")
    dst.assert_margins_untouched()
    assert torch.equal(indices, i_before) and torch.equal(values, v_before)


IDX_DTYPES = [torch.int32, torch.int64]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ddt,vdt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("idt", IDX_DTYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("nnz,dups", [(0, False), (1, False), (7, False), (4099, False),
                                      (7, True), (4099, True)],
                         ids=["0", "1", "7", "4099", "7dup", "4099dup"])
def test_merge_sparse(device, ddt, vdt, idt, nnz, dups):
    check_merge_sparse(device, 10007, ddt, vdt, idt, nnz, dups, 0.3 if dups else 1.0,
                       seed=nnz + 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight", [1.0, -0.75])
def test_merge_sparse_weighted(device, weight):
    check_merge_sparse(device, 5000, f32, f16, torch.int64, 500, False, weight, seed=14)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ddt,vdt,idt", [(f32, f32, torch.int32), (bf16, f16, torch.int64)],
                         ids=["f32-f32-i32", "bf16-f16-i64"])
def test_merge_sparse_large(device, ddt, vdt, idt):
    """A multi-million dst with top-1% style unique indices, and a run with many duplicates."""
    check_merge_sparse(device, BIG, ddt, vdt, idt, BIG // 100, False, 1.0, seed=15, offset=1)
    check_merge_sparse(device, 50_000, ddt, vdt, idt, 200_000, True, 0.5, seed=16, offset=1)


@contextlib.contextmanager
def cpu_threads(n):
    before = K.num_threads()
    K.set_num_threads(n)
    try:
        yield
    finally:
        K.set_num_threads(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ddt,vdt,idt", [(f32, f32, torch.int32), (bf16, f32, torch.int64)],
                         ids=["f32-f32-i32", "bf16-f32-i64"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_merge_sparse_long_ascending(device, ddt, vdt, idt, threads):
    """Long ascending index lists, in top-k order: unique ones, and runs of duplicates, on 1 to
    3 kernel threads."""
    with cpu_threads(threads):
        check_merge_sparse(device, BIG, ddt, vdt, idt, BIG // 20, False, 1.0, seed=22, offset=1,
                           ascending=True)
        check_merge_sparse(device, 50_000, ddt, vdt, idt, 300_000, True, 0.5, seed=23, offset=1,
                           ascending=True)


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_merge_sparse_threads_give_the_serial_bits(threads):
    # The bits must not depend on the thread count: bf16 rounds after every add, so a
    # duplicate added out of order (by a scatter split among threads) changes them.
    g = gen(24)
    idx = torch.randint(0, 20_000, (200_000,), generator=g).sort().values
    vals = torch.randn(idx.numel(), generator=g)
    dst0 = torch.randn(20_000, generator=g).to(bf16)
    results = []
    for n in (1, threads):
        dst = dst0.clone()
        with cpu_threads(n):
            assert K.merge_sparse(dst, idx, vals, 0.3)
        results.append(dst)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("threads", [2, 3])
def test_merge_sparse_keeps_a_run_of_one_index_in_one_thread(threads):
    # Ascending indices whose runs span every equal split of the positions: two threads
    # adding to one element at once would lose adds (a read-modify-write race).
    runs = [torch.full((70_000,), 5), torch.full((70_000,), 9), torch.full((1,), 11)]
    idx = torch.cat(runs)
    dst = torch.zeros(16)
    with cpu_threads(threads):
        assert K.merge_sparse(dst, idx, torch.ones(idx.numel()), 1.0)
    expected = torch.zeros(16)
    expected[5], expected[9], expected[11] = 70_000, 70_000, 1
    assert torch.equal(dst, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [1, 3])
def test_merge_sparse_misaligned_and_nd_dst(device, offset):
    check_merge_sparse(device, 4096, f16, f32, torch.int32, 333, False, 1.0, seed=18,
                       offset=offset, dst_shape=(16, 16, 16))


@pytest.mark.parametrize("device", DEVICES)
def test_merge_sparse_empty_dst(device):
    dst = torch.zeros(0, device=device)
    assert K.merge_sparse(dst, torch.zeros(0, dtype=torch.int32, device=device),
                          torch.zeros(0, device=device), 1.0) is True


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(numel=st.integers(1, 3000), ddt=dtypes_st, vdt=dtypes_st,
       idt=st.sampled_from(IDX_DTYPES), nnz=st.integers(0, 4000), dups=st.booleans(),
       weight=st.sampled_from([1.0, 0.5, -2.0]), seed=st.integers(0, 2 ** 31))
def test_merge_sparse_hypothesis(device, numel, ddt, vdt, idt, nnz, dups, weight, seed):
    if not dups:
        nnz = min(nnz, numel)
    check_merge_sparse(device, numel, ddt, vdt, idt, nnz, dups, weight, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("vdt", DTYPES, ids=dt_ids(DTYPES))
@pytest.mark.parametrize("where", [0, 500, 999])
def test_merge_sparse_nonfinite_writes_nothing(device, bad, vdt, where):
    g = gen(19)
    dst = Guarded(5000, f32, device, g=g)
    idx = torch.randperm(5000, generator=g)[:1000].to(device)
    vals = torch.randn(1000, generator=g).to(vdt).to(device)
    vals[where] = bad
    assert K.merge_sparse(dst.flat, idx, vals, 0.5) is False
    dst.assert_untouched()


# --------------------------------------------------------------------------------------------
# weighted_sum


def check_weighted_sum(device, shapes, odt, idts, weights, seed, offset=0, single=False):
    g = gen(seed)
    out = [rand(s, d, device, g, offset) for s, d in zip(shapes, per_tensor(odt, shapes))]
    inputs = [[rand(s, d, device, g, offset) for s, d in zip(shapes, per_tensor(idt, shapes))]
              for idt in idts]
    snaps = [snapshot(x) for x in inputs]
    acc = torch.zeros(sum(o.numel() for o in out))
    mag = torch.zeros(acc.numel(), dtype=torch.float64)
    for w, x in zip(weights, inputs):
        x32 = cat32(x)
        acc = acc + x32 * w
        mag = mag + abs(w) * x32.double().abs()
    exact = len(weights) == 1 and weights[0] == 1.0
    if single:
        ret = K.weighted_sum(out[0], [x[0] for x in inputs], weights)
        assert ret is out[0]
    else:
        ret = K.weighted_sum(out, inputs, weights)
        assert ret is out
    assert_list_matches(out, acc, None if exact else mag,
                   roundings=2.0 * len(weights) + 2, what="weighted_sum out")
    for k, (x, s) in enumerate(zip(inputs, snaps)):
        assert_unchanged(x, s, f"inputs[{k}]")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("odt,idt", DTYPE_PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("weights", [[1.0], [0.5, 0.5], [0.1, 0.2, 0.3, 0.4]],
                         ids=["K1", "K2", "K4"])
def test_weighted_sum(device, odt, idt, n, weights):
    check_weighted_sum(device, shapes_for(n), odt, [idt] * len(weights), weights, seed=n + 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("odt,idt", [(f32, f32), (bf16, f32)], ids=["f32-f32", "bf16-f32"])
def test_weighted_sum_large(device, odt, idt):
    check_weighted_sum(device, [(BIG,), (2, 1001), (BIG,)], odt, [idt] * 4, [0.25, 0.25, 0.3, 0.2],
                       seed=21, offset=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [1, 3])
def test_weighted_sum_misaligned(device, offset):
    check_weighted_sum(device, [(4099,), (7,), (33, 31), (1,)], f16, [f32, f32], [0.75, 0.25],
                       seed=22, offset=offset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", [1, 2, 37, 500])
def test_weighted_sum_many_tensors(device, count):
    shapes = random_shapes(gen(count + 300), count)
    check_weighted_sum(device, shapes, f32, [f32] * 3, [0.5, 0.25, 0.25], seed=count)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 9])
@pytest.mark.parametrize("in_place", [False, True])
def test_weighted_sum_is_the_left_to_right_fp32_sum(device, k, in_place):
    # Up to four inputs run as one elementwise pass, more in groups of four through a block:
    # both must give the bits of w0*x0 + w1*x1 + ... rounded left to right. In place is how
    # the outer optimizers call it (out is inputs[0]).
    g = gen(40 + k)
    shapes = [(5000,), (3, 7), (1,)] + ([(4_200_000,)] if k in (2, 5) else [])  # streamed
    ins = [[torch.randn(s, generator=g).to(device) for s in shapes] for _ in range(k)]
    w = [float(x) for x in torch.randn(k, generator=g)]
    ref = [w[0] * t for t in ins[0]]
    for wk, xs in zip(w[1:], ins[1:]):
        ref = [r + wk * x for r, x in zip(ref, xs)]
    out = ins[0] if in_place else [torch.empty_like(t) for t in ins[0]]
    K.weighted_sum(out, ins, w)
    for o, r in zip(out, ref):
        assert torch.equal(o, r)


@pytest.mark.parametrize("device", DEVICES)
def test_weighted_sum_single_tensor(device):
    check_weighted_sum(device, [(9, 2)], f32, [bf16, bf16], [2.0, -1.0], seed=23, single=True)


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(shapes=list_case(max_tensors=8), odt=dtypes_st, idt=dtypes_st,
       weights=st.lists(st.floats(-4, 4, allow_nan=False, width=32), min_size=1, max_size=5),
       offset=st.integers(0, 2), seed=st.integers(0, 2 ** 31))
def test_weighted_sum_hypothesis(device, shapes, odt, idt, weights, offset, seed):
    # All K inputs share one dtype (ashl.kernels rejects mixed input dtypes); out's is free.
    check_weighted_sum(device, shapes, odt, [idt] * len(weights), weights, seed, offset)


# --------------------------------------------------------------------------------------------
# flat_numel


def test_flat_numel():
    ts = [torch.zeros(3, 4), torch.zeros(0), torch.zeros(()), torch.zeros(5, dtype=f16)]
    assert K.flat_numel(ts) == 12 + 0 + 1 + 5
    assert K.flat_numel([]) == 0
    assert K.flat_numel(torch.zeros(2, 3)) == 6


# --------------------------------------------------------------------------------------------
# lists whose tensors have different dtypes (a model with fp32 and half-precision parameters)

MIXED_SHAPES = [(4099,), (7,), (33, 31), (1,), (0,), (300,)]
MIXED = [f32, f16, bf16, f32, f16, bf16]
MIXED2 = [bf16, f32, f16, f16, bf16, f32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fdt", DTYPES, ids=dt_ids(DTYPES))
def test_mixed_dtype_lists(device, fdt):
    check_pack(device, MIXED_SHAPES, MIXED, fdt, 1.0, False, seed=30)
    check_pack(device, MIXED_SHAPES, MIXED, fdt, -0.5, True, seed=31, offset=1)
    check_unpack(device, MIXED_SHAPES, MIXED, fdt, False, seed=32)
    check_unpack(device, MIXED_SHAPES, MIXED, fdt, True, seed=33, offset=3)
    check_merge_dense(device, MIXED_SHAPES, MIXED, MIXED2, 1.0, seed=34)
    check_merge_dense(device, MIXED_SHAPES, MIXED, [fdt] * 6, 0.3, seed=35)
    check_weighted_sum(device, MIXED_SHAPES, MIXED, [MIXED2] * 3, [0.5, 0.25, 0.25], seed=36)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad_at", [0, 2, 5])
def test_merge_dense_mixed_dtypes_nonfinite_writes_nothing(device, bad_at):
    """With several (dst, delta) dtype pairs a NaN in any pair must stop every pair."""
    g = gen(37)
    dst = [rand(s, d, device, g) for s, d in zip(MIXED_SHAPES, MIXED)]
    delta = [rand(s, d, device, g) for s, d in zip(MIXED_SHAPES, MIXED2)]
    delta[bad_at].view(-1)[-1] = float("nan")
    snaps = snapshot(dst)
    assert K.merge_dense(dst, delta, 0.5) is False
    assert_unchanged(dst, snaps, "dst")


@pytest.mark.parametrize("device", DEVICES)
@HYP
@given(data=st.data(), fdt=dtypes_st, scale=st.sampled_from([1.0, -0.25]),
       with_res=st.booleans(), add=st.booleans(), seed=st.integers(0, 2 ** 31))
def test_mixed_dtype_lists_hypothesis(device, data, fdt, scale, with_res, add, seed):
    shapes = data.draw(list_case(max_tensors=10))
    pdts = data.draw(st.lists(dtypes_st, min_size=len(shapes), max_size=len(shapes)))
    check_pack(device, shapes, pdts, fdt, scale, with_res, seed)
    check_unpack(device, shapes, pdts, fdt, add, seed + 1)
    edts = data.draw(st.lists(dtypes_st, min_size=len(shapes), max_size=len(shapes)))
    check_merge_dense(device, shapes, pdts, edts, 0.5, seed + 2)
