"""The CPU and CUDA back ends run the same op definitions: on the same inputs they give the
same bits (both compile without FMA contraction). Needs a CUDA device; skipped without one.
(The kernel tests of tests/unit compare each back end with plain torch; their cuda cases run
here too when a device is present.)"""
import pytest
import torch

from ashl import kernels

pytestmark = pytest.mark.skipif(not kernels.cuda_available(),
                                reason="needs ashl built with CUDA and a CUDA device")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(0,), (1,), (7, 3), (4099,), (70_000,), (2, 65_536 + 5)]


def tensors(dtype, seed, offset=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in SHAPES:
        n = torch.Size(shape).numel()
        base = torch.randn(n + offset, generator=g).to(dtype)
        out.append(base[offset:].view(shape))
    return out


def both(ts):
    return ts, [t.cuda() for t in ts]


def same(cpu, gpu):
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu()), (a.dtype, a.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_pack_delta_with_residual_and_scale(dtype, offset):
    (p, pg), (a, ag), (r, rg) = (both(tensors(dtype, s, offset)) for s in (1, 2, 3))
    n = kernels.flat_numel(p)
    out, outg = torch.empty(n), torch.empty(n, device="cuda")
    kernels.pack_delta(p, a, out, scale=0.37, residuals=r)
    kernels.pack_delta(pg, ag, outg, scale=0.37, residuals=rg)
    assert torch.equal(out, outg.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add", [False, True])
def test_unpack(dtype, add):
    (p, pg), (a, ag) = both(tensors(dtype, 4)), both(tensors(dtype, 5))
    flat = torch.randn(kernels.flat_numel(p))
    op = kernels.unpack_add if add else kernels.unpack_assign
    op(p, a, flat)
    op(pg, ag, flat.cuda())
    same(p, pg)
    same(a, ag)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_dense_and_sparse(dtype):
    (d, dg), (x, xg) = both(tensors(dtype, 6)), both(tensors(dtype, 7))
    assert kernels.merge_dense(d, x, 0.25) and kernels.merge_dense(dg, xg, 0.25)
    same(d, dg)
    dst = torch.randn(10_000).to(dtype)
    dstg = dst.cuda()
    idx = torch.randperm(10_000)[:999].sort().values.to(torch.int32)
    vals = torch.randn(999)
    assert kernels.merge_sparse(dst, idx, vals, 0.5)
    assert kernels.merge_sparse(dstg, idx.cuda(), vals.cuda(), 0.5)
    assert torch.equal(dst, dstg.cpu())


def test_weighted_sum_of_many_inputs():
    ins = [tensors(torch.float32, 10 + k) for k in range(11)]
    w = [0.1 * (k + 1) for k in range(11)]
    out, outg = tensors(torch.float32, 99), [t.cuda() for t in tensors(torch.float32, 99)]
    kernels.weighted_sum(out, ins, w)
    kernels.weighted_sum(outg, [[t.cuda() for t in x] for x in ins], w)
    same(out, outg)
