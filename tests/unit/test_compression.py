"""ashl.compression: none / fp16 / top-k payloads, error feedback, server-side merge."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

from ashl import kernels, protocol as P
from ashl.stages import Stage
from ashl.compression import (Compression, FP16Compressor, NoneCompressor, Payload, Residual,
                              TopKCompressor)

floats = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)


def vec(values):
    return torch.tensor(values, dtype=torch.float32)


# --- namespace --------------------------------------------------------------------------

def test_namespace_feels_like_horovod():
    assert isinstance(Compression.none, NoneCompressor)
    assert isinstance(Compression.fp16, FP16Compressor)
    c = Compression.topk(0.01)
    assert isinstance(c, TopKCompressor) and c.ratio == 0.01
    assert repr(c) == "Compression.topk(0.01)" and repr(Compression.fp16) == "Compression.fp16"


@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.0001, 2, math.nan, math.inf, True, "0.1", None])
def test_topk_ratio_validated(ratio):
    with pytest.raises(ValueError, match="ratio"):
        Compression.topk(ratio)


def test_delta_validated():
    for bad in (torch.zeros(4, dtype=torch.float64), torch.zeros(4, 2)[:, 0]):
        with pytest.raises(ValueError):
            Compression.none.compress(bad)
    with pytest.raises(TypeError):
        Compression.topk(0.5).compress([1.0, 2.0])
    with pytest.raises(ValueError, match="residual"):
        Compression.none.compress(torch.zeros(4), Residual([torch.zeros(5)]))


# --- dense --------------------------------------------------------------------------------

def test_none_sends_everything_and_clears_residual():
    d = torch.randn(1000)
    r = Residual([torch.zeros(1000)])
    r.flat.fill_(3.0)
    p = Compression.none.compress(d, r)
    assert p.kind == P.Kind.DENSE_DELTA and p.dtype == P.DType.FLOAT32 and p.nbytes == 4000
    assert torch.equal(p.values, d) and torch.equal(p.to_dense(), d)
    assert r.flat.abs().sum() == 0


def test_fp16_halves_bytes_and_feeds_back_rounding():
    d = torch.randn(1000) * 10
    r = Residual([torch.zeros(1000)])
    p = Compression.fp16.compress(d, r)
    assert p.dtype == P.DType.FLOAT16 and p.nbytes == 2000
    assert torch.equal(p.values.float() + r.flat, d)  # sent + kept == delta, exactly
    assert r.flat.abs().max() <= d.abs().max() * 2**-10
    assert torch.allclose(p.to_dense(), d, rtol=1e-3)


# --- top-k --------------------------------------------------------------------------------

@given(st.lists(floats, min_size=1, max_size=300), st.floats(0.001, 1.0))
def test_topk_properties(values, ratio):
    d = vec(values)
    n = d.numel()
    comp = Compression.topk(ratio, dense_when_cheaper=False)
    r = Residual([torch.zeros(n)])
    p = comp.compress(d.clone(), r)
    k = min(n, max(1, math.ceil(ratio * n)))
    assert comp.k(n) == k
    if k == n:   # ratio 1.0 (or rounding up to all): dense, everything sent
        assert p.kind == P.Kind.DENSE_DELTA and torch.equal(p.values, d)
        assert r.flat.abs().sum() == 0
        return
    assert p.kind == P.Kind.SPARSE_DELTA and p.nnz == k and p.nbytes == 8 * k
    idx, val = p.indices, p.values
    assert idx.dtype == torch.int32 and val.dtype == torch.float32
    assert torch.all(idx[1:] > idx[:-1])                       # ascending, no duplicates
    assert torch.equal(val, d[idx.long()])
    sent = torch.zeros(n, dtype=torch.bool)
    sent[idx.long()] = True
    if k < n:
        assert d[sent].abs().min() >= d[~sent].abs().max()     # exact top-k by magnitude
    assert torch.equal(p.to_dense() + r.flat, d)               # sent + residual == delta
    assert torch.all(r.flat[sent] == 0)


def test_topk_ratio_one_is_dense_equivalent():
    d = torch.randn(777)
    r = Residual([torch.zeros(777)])
    p = Compression.topk(1.0).compress(d, r)
    assert p.kind == P.Kind.DENSE_DELTA and p.nbytes == 4 * 777
    assert torch.equal(p.to_dense(), d) and r.flat.abs().sum() == 0


def test_topk_dense_when_cheaper():
    d = torch.randn(100)
    assert Compression.topk(0.6).compress(d).kind == P.Kind.DENSE_DELTA      # 60 * 8 > 400 bytes
    p = Compression.topk(0.6, dense_when_cheaper=False).compress(d)
    assert p.kind == P.Kind.SPARSE_DELTA and p.nnz == 60
    assert Compression.topk(0.4).compress(d).kind == P.Kind.SPARSE_DELTA     # 320 < 400 bytes
    assert Compression.topk(0.4).max_nbytes(100) == 320 and Compression.topk(0.6).max_nbytes(100) == 400


def test_topk_ties_and_tiny():
    d = torch.ones(10)
    p = Compression.topk(0.3).compress(d)
    assert p.nnz == 3 and len(set(p.indices.tolist())) == 3
    assert Compression.topk(1e-9).k(10) == 1        # always at least one entry
    d = vec([0.0, -5.0, 1.0, 2.0, 0.5, 0.1, 0.0, 0.0, 0.0, 0.0])
    assert Compression.topk(0.5).compress(d).kind == P.Kind.DENSE_DELTA  # 5 * 8 bytes >= 40
    p = Compression.topk(0.2).compress(d)
    assert p.indices.tolist() == [1, 3] and p.values.tolist() == [-5.0, 2.0]


def test_output_buffer_is_reused():
    comp = Compression.topk(0.1)
    out = torch.empty(comp.max_nbytes(1000), dtype=torch.uint8)
    p = comp.compress(torch.randn(1000), out=out)
    assert p.buffer.data_ptr() == out.data_ptr() and p.nbytes == 800
    with pytest.raises(ValueError, match="needs"):
        comp.compress(torch.randn(1000), out=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        comp.compress(torch.randn(1000), out=torch.empty(800))


# --- error feedback through pack_delta ------------------------------------------------------------

def test_error_feedback_loses_nothing_over_commits():
    torch.manual_seed(0)
    params = [torch.randn(30, 20), torch.randn(50)]
    anchors = [p.clone() for p in params]
    residual = Residual(params)
    flat = torch.empty(kernels.flat_numel(params))
    comp = Compression.topk(0.05)
    raw_total, sent_total = torch.zeros(flat.numel()), torch.zeros(flat.numel())
    for _ in range(20):
        for p in params:
            p.add_(torch.randn_like(p) * 0.1)   # some local steps
        raw_total += torch.cat([(p - a).flatten() for p, a in zip(params, anchors)])
        kernels.pack_delta(params, anchors, flat, residuals=residual.views)   # delta + residual
        payload = comp.compress(flat, residual)
        sent = payload.to_dense()
        sent_total += sent
        kernels.unpack_add(params, anchors, sent)   # a lone rank: the server echoes what it got
    assert payload.kind == P.Kind.SPARSE_DELTA
    assert torch.allclose(sent_total + residual.flat, raw_total, atol=1e-4)
    # without feedback the unsent part would be lost:
    assert residual.norm() > 0


def test_residual_views_alias_flat():
    params = [torch.zeros(3, 4), torch.zeros(5)]
    r = Residual(params)
    assert [v.shape for v in r.views] == [p.shape for p in params]
    r.views[1].fill_(2.0)
    assert r.flat[12:].sum() == 10 and r.flat[:12].sum() == 0
    with pytest.raises(ValueError, match="fp32"):
        Residual([torch.zeros(3, dtype=torch.float16)])


# --- server side -----------------------------------------------------------------------

@pytest.mark.parametrize("comp", [Compression.none, Compression.fp16, Compression.topk(0.1)])
def test_merge_into_matches_dense_add(comp):
    torch.manual_seed(1)
    d, glob = torch.randn(500), torch.randn(500)
    p = comp.compress(d)
    expected = glob + 0.25 * p.to_dense()
    assert p.merge_into(glob, 0.25)
    assert torch.allclose(glob, expected, atol=1e-6)


@pytest.mark.parametrize("comp", [Compression.none, Compression.topk(0.1)])
def test_merge_rejects_non_finite(comp):
    d = torch.randn(500)
    d[7] = math.inf
    glob = torch.randn(500)
    before = glob.clone()
    assert not comp.compress(d).merge_into(glob, 0.5)
    assert torch.equal(glob, before)


def test_fp16_overflow_is_rejected_by_server():
    glob = torch.zeros(4)
    assert not Compression.fp16.compress(vec([1.0, 1e6, 0.0, 0.0])).merge_into(glob, 1.0)


def test_payload_over_the_wire_format():
    """Payload -> header fields -> encode/decode -> Payload.from_message sees the same delta."""
    d = torch.randn(2000)
    for comp in (Compression.none, Compression.fp16, Compression.topk(0.02)):
        p = comp.compress(d)
        h = P.Header(rank=1, stage=Stage.SHL, link_ratio=comp.ratio, **p.header_fields())
        h2 = P.decode(P.encode(h), world_size=2, model_numel=2000)
        assert h2.payload_nbytes == p.nbytes
        raw = p.buffer.clone()   # what the receiver's buffer holds
        q = Payload.from_message(h2, raw)
        assert torch.equal(q.to_dense(), p.to_dense())
        if q.sparse:
            i, v = P.sparse_views(h2, raw)
            assert torch.equal(i, p.indices) and torch.equal(v, p.values)
    with pytest.raises(ValueError):
        Payload.from_message(P.Header(P.Kind.REPLY, rank=0), torch.zeros(0, dtype=torch.uint8))


# --- pack: the one commit path every compressor takes ------------------------------------------

def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in ((7, 3), (1,), (130,))]
    anchors = [p + torch.randn(p.shape, generator=g) for p in params]
    return params, anchors


@pytest.mark.parametrize("comp", [Compression.none, Compression.fp16, Compression.topk(0.1),
                                  Compression.topk(0.9)], ids=repr)
@pytest.mark.parametrize("with_residual", [False, True])
def test_pack_is_pack_delta_then_compress(comp, with_residual):
    params, anchors = _model()
    n = kernels.flat_numel(params)
    res_a = Residual(params) if with_residual else None
    res_b = Residual(params) if with_residual else None
    if with_residual:
        res_a.flat.copy_(torch.linspace(-1, 1, n))
        res_b.flat.copy_(res_a.flat)
    scratch = torch.full((n,), 99.0)
    out = torch.empty(comp.max_nbytes(n), dtype=torch.uint8)
    got = comp.pack(params, anchors, res_a, scratch, out)
    delta = torch.cat([(p - a).reshape(-1) for p, a in zip(params, anchors)])
    if with_residual:
        delta += res_b.flat
    want = comp.compress(delta.clone(), res_b)
    assert (got.kind, got.dtype, got.numel, got.nnz) == (want.kind, want.dtype, want.numel, want.nnz)
    assert torch.equal(got.buffer, want.buffer)
    if with_residual:
        assert torch.equal(res_a.flat, res_b.flat)
        # what was sent plus what is kept is the whole delta: nothing is lost
        assert torch.allclose(got.to_dense() + res_a.flat, delta, atol=1e-6)


def test_dense_pack_writes_the_wire_buffer_directly():
    params, anchors = _model(1)
    n = kernels.flat_numel(params)
    out = torch.empty(4 * n + 16, dtype=torch.uint8)
    payload = Compression.none.pack(params, anchors, None, None, out)   # no scratch needed
    assert payload.buffer.data_ptr() == out.data_ptr()
    assert torch.equal(payload.values, torch.cat([(p - a).reshape(-1) for p, a in zip(params, anchors)]))


def test_check_compression_maps_horovod_and_refuses_what_a_strategy_cannot_send():
    from ashl.compression import check_compression

    class NoneCompressor:          # the names of horovod.torch.compression's classes
        pass

    class FP16Compressor:
        pass

    assert check_compression(None, "ashl", ("none",)) is None
    # Horovod's default, which its examples pass when nothing was asked: the plan's choice
    assert check_compression(NoneCompressor, "ashl", ("none", "fp16")) is None
    assert check_compression(FP16Compressor, "bsp", ("none", "fp16")) is Compression.fp16
    assert check_compression(Compression.topk(0.1), "ashl", ("topk",)).ratio == 0.1
    with pytest.raises(ValueError, match=r"strategy 'localsgd' cannot send with compression="
                                         r"Compression.fp16 \(it takes none\)"):
        check_compression(Compression.fp16, "localsgd", ("none",))
    with pytest.raises(ValueError, match="compression='gzip': not a compressor ashl knows"):
        check_compression("gzip", "ashl", ("none",))


def test_a_top_k_repr_is_exact():
    """(its name rounds the ratio; the ranks' agreement on options compares reprs)"""
    assert repr(Compression.topk(0.1)) == "Compression.topk(0.1)"
    assert repr(Compression.topk(0.1000001, dense_when_cheaper=False)) \
        == "Compression.topk(0.1000001, dense_when_cheaper=False)"
