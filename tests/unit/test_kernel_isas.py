"""The CPU kernels' fp16/bf16 conversion paths (AVX-512, F16C + AVX2, portable), chosen at run
time: every 16-bit value widens, and fp32 values (random bit patterns and the rounding edges)
narrow, to the same bits on every path, and to torch's (a NaN is a NaN: torch canonicalises
bf16 NaNs, the kernels keep the payload's top bits, on every path alike)."""
import pytest
import torch

import ashl.kernels as K

ISAS = K.supported_cpu_isas()
ALL16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
EDGES = [0x7f800000, 0x7f800001, 0x7fa00000, 0xffc00001, 0x7f7fffff, 0x477fefff, 0x477ff000,
         0x38800000, 0x387fffff, 0x33000000, 0x33000001, 0x3f808000, 0x3f818000, 0x80000000, 0]


def fp32_patterns(n=100_000):
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64)
    edges = torch.tensor([e - (1 << 32) if e >= 1 << 31 else e for e in EDGES], dtype=torch.int64)
    return torch.cat([rand, edges]).to(torch.int32).view(torch.float32)


def widen(dtype):
    """unpack_assign from a 16-bit flat into fp32 tensors: a plain widening, no arithmetic."""
    p, a = torch.empty(1 << 16), torch.empty(1 << 16)
    K.unpack_assign([p], [a], ALL16.view(dtype).clone())
    assert torch.equal(p.view(torch.int32), a.view(torch.int32))
    return p.view(torch.int32)


def narrow(values, dtype):
    """unpack_assign from an fp32 flat into 16-bit tensors: a plain narrowing."""
    p, a = torch.empty(len(values), dtype=dtype), torch.empty(len(values), dtype=dtype)
    K.unpack_assign([p], [a], values.clone())
    return p.view(torch.int16)


@pytest.fixture
def each_isa():
    yield
    K.set_cpu_isa("auto")


def test_the_best_path_is_chosen_and_portable_is_always_there(each_isa):
    assert ISAS[-1] == "portable" and K.cpu_isa() == ISAS[0]
    K.set_cpu_isa("portable")
    assert K.cpu_isa() == "portable"
    K.set_cpu_isa("auto")
    assert K.cpu_isa() == ISAS[0]
    with pytest.raises(ValueError, match="unknown kernel ISA 'sse9'"):
        K.set_cpu_isa("sse9")
    for isa in {"avx512", "f16c"} - set(ISAS):
        with pytest.raises(ValueError, match=f"this CPU cannot run the '{isa}' kernels"):
            K.set_cpu_isa(isa)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_path_gives_the_same_bits_as_portable_and_torch(dtype, each_isa):
    values = fp32_patterns()
    K.set_cpu_isa("portable")
    ref_wide, ref_narrow = widen(dtype), narrow(values, dtype)
    assert torch.equal(ref_wide, ALL16.view(dtype).float().view(torch.int32))
    torch_narrow = values.to(dtype)
    nan = torch_narrow.isnan()
    assert torch.equal(ref_narrow[~nan], torch_narrow.view(torch.int16)[~nan])
    assert ref_narrow.view(dtype)[nan].isnan().all()
    for isa in ISAS:
        K.set_cpu_isa(isa)
        assert torch.equal(widen(dtype), ref_wide), isa
        assert torch.equal(narrow(values, dtype), ref_narrow), isa


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_a_streamed_narrowing_gives_the_same_bits_on_every_path(dtype, offset, each_isa):
    """pack_delta into a 16-bit buffer, its operands past the streaming threshold (32 MiB):
    the non-temporal stores, after a scalar head up to their alignment, on every path."""
    n = 3_500_011
    p = torch.cat([fp32_patterns(), torch.randn(n - 100_000 - len(EDGES))])
    a = torch.zeros(n)
    results = []
    for isa in ISAS:
        K.set_cpu_isa(isa)
        out = torch.full((n + offset + 5,), 7.0, dtype=dtype)
        K.pack_delta([p], [a], out[offset:offset + n])
        assert torch.equal(out[:offset], torch.full((offset,), 7.0, dtype=dtype)), isa
        assert torch.equal(out[offset + n:], torch.full((5,), 7.0, dtype=dtype)), isa
        results.append(out[offset:offset + n].view(torch.int16))
    assert all(torch.equal(r, results[-1]) for r in results), ISAS
    finite = p.to(dtype).isfinite()
    assert torch.equal(results[0].view(dtype)[finite], p.to(dtype)[finite])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_streamed_16_bit_output_at_an_odd_address_is_written_normally(dtype, each_isa):
    """A tensor at a byte offset into a buffer can never be aligned for a streaming store
    (which would fault): it is narrowed with normal stores, on every path."""
    n = 3_500_011
    p, a = torch.randn(n), torch.zeros(n)
    for isa in ISAS:
        K.set_cpu_isa(isa)
        buf = bytearray(2 * n + 4)
        out = torch.frombuffer(buf, dtype=dtype, offset=1, count=n)
        assert out.data_ptr() % 2 == 1
        K.pack_delta([p], [a], out)
        assert torch.equal(out, p.to(dtype)), isa
        assert buf[0] == 0 and buf[-3:] == b"\0\0\0", isa


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("offset", [0, 1, 3, 8])
def test_a_streamed_weighted_sum_of_five_into_16_bits_on_every_path(dtype, offset, each_isa):
    """More than four inputs go through an fp32 block, four at a time; its 16-bit output,
    streamed past the threshold, starts its blocks on cache lines after a first short one:
    the bits of the left-to-right fp32 sum, narrowed, at every offset and on every path."""
    n = 2_000_003
    g = torch.Generator().manual_seed(offset)
    ins = [torch.randn(n, generator=g) for _ in range(5)]
    w = [0.5, -0.25, 0.125, 1.0, 0.75]
    ref = w[0] * ins[0]
    for wk, x in zip(w[1:], ins[1:]):
        ref = ref + wk * x
    for isa in ISAS:
        K.set_cpu_isa(isa)
        out = torch.full((n + offset + 5,), 7.0, dtype=dtype)
        K.weighted_sum([out[offset:offset + n]], [[x] for x in ins], w)
        assert torch.equal(out[offset:offset + n], ref.to(dtype)), isa
        assert (out[:offset] == 7).all() and (out[offset + n:] == 7).all(), isa
