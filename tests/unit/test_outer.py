"""Outer optimizers against plain-torch references of each rule, over random sequences of
deltas and weights (the staleness damping is a factor of the weight), dense and sparse."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ashl.compression import Compression, Payload
from ashl.protocol import DType, Kind
from ashl.outer import (DelayedNesterovOuter, NesterovOuter, OuterSpec, PlainMerge, make_outer,
                        parse_outer)
from ashl.staleness import parse_staleness

N = 37


def own(p: Payload) -> Payload:
    """A payload with its own bytes (a compressor reuses its output buffer)."""
    return Payload(p.kind, p.dtype, p.numel, p.nnz, p.buffer.clone())


def sparse(indices, values, numel=N) -> Payload:
    """A sparse payload as the wire carries it (int32 indices ascending, then fp32 values)."""
    idx = torch.as_tensor(indices, dtype=torch.int32)
    val = torch.as_tensor(values, dtype=torch.float32)
    return Payload(Kind.SPARSE_DELTA, DType.FLOAT32, numel, len(idx),
                   torch.cat([idx.view(torch.uint8), val.view(torch.uint8)]))


def payloads(seed: int, count: int, kind: str):
    """`count` random updates as the server receives them: dense fp32, fp16 or top-k."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        delta = torch.randn(N, generator=g) * 0.1
        if kind == "dense":
            out.append(Payload.dense(delta))
        elif kind == "fp16":
            out.append(own(Compression.fp16.compress(delta)))
        else:
            out.append(own(Compression.topk(0.3).compress(delta)))
    return out


sequences = st.fixed_dictionaries({
    "seed": st.integers(0, 2 ** 16),
    "count": st.integers(1, 12),
    "kind": st.sampled_from(["dense", "fp16", "topk"]),
    "weights": st.lists(st.floats(0.05, 1.0), min_size=12, max_size=12),
    "staleness": st.lists(st.integers(0, 6), min_size=12, max_size=12),
    "lr": st.floats(0.1, 1.5),
    "momentum": st.floats(0.05, 0.95),   # torch: nesterov needs momentum > 0
})


def damped(case):
    """Each update's weight: a merge weight times its staleness damping, as the server's."""
    damp = parse_staleness("polynomial(0.5)")
    return [w * damp(s) for w, s in zip(case["weights"], case["staleness"])][:case["count"]]


@given(sequences)
@settings(max_examples=60, deadline=None)
def test_none_is_the_plain_weighted_sum(case):
    ups, weights = payloads(case["seed"], case["count"], case["kind"]), damped(case)
    model, ref = torch.zeros(N), torch.zeros(N, dtype=torch.float64)
    outer = make_outer("none", N, round_updates=3)
    assert isinstance(outer, PlainMerge)
    for p, w in zip(ups, weights):
        assert outer.step(model, p, w)
        ref += w * p.to_dense().double()
    torch.testing.assert_close(model.double(), ref, rtol=1e-5, atol=1e-6)


@given(sequences)
@settings(max_examples=60, deadline=None)
def test_nesterov_is_torch_sgd_nesterov_on_minus_the_update(case):
    ups, weights = payloads(case["seed"], case["count"], case["kind"]), damped(case)
    lr, b = case["lr"], case["momentum"]
    model = torch.zeros(N)
    outer = make_outer(f"nesterov({lr!r}, {b!r})", N, round_updates=3)
    assert isinstance(outer, NesterovOuter)
    ref = torch.nn.Parameter(torch.zeros(N, dtype=torch.float64))
    sgd = torch.optim.SGD([ref], lr=lr, momentum=b, nesterov=True)
    for p, w in zip(ups, weights):
        assert outer.step(model, p, w)
        ref.grad = -w * p.to_dense().double()      # DiLoCo's pseudo-gradient
        sgd.step()
    torch.testing.assert_close(model.double(), ref.detach(), rtol=1e-4, atol=1e-5)


def paper_delayed_nesterov(grads, lr, b, n):
    """Algorithm 3 of Liu et al. 2024 as written (pseudo-gradients g, buffer of n)."""
    theta = torch.zeros(N, dtype=torch.float64)
    m, acc = torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        acc += g
        if t % n == 0:
            m = b * m + acc / n
            theta = theta - lr * (g / n + b * m)
            acc.zero_()
        else:
            theta = theta - lr * g / n
    return theta


@given(sequences, st.integers(1, 5))
@settings(max_examples=60, deadline=None)
def test_delayed_nesterov_is_the_papers_algorithm(case, n):
    """With merge weight 1/n (async-localsgd), the weighted update is the paper's g / n."""
    ups = payloads(case["seed"], case["count"], case["kind"])
    lr, b = case["lr"], case["momentum"]
    model = torch.zeros(N)
    outer = make_outer(f"delayed-nesterov({lr!r}, {b!r})", N, round_updates=n)
    assert isinstance(outer, DelayedNesterovOuter) and outer.n == n
    for p in ups:
        assert outer.step(model, p, 1.0 / n)
    ref = paper_delayed_nesterov([-p.to_dense().double() for p in ups], lr, b, n)
    torch.testing.assert_close(model.double(), ref, rtol=1e-4, atol=1e-5)


@given(sequences, st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_delayed_nesterov_at_each_nth_update_is_one_torch_nesterov_step_on_their_sum(case, n):
    ups, weights = payloads(case["seed"], case["count"], case["kind"]), damped(case)
    lr, b = case["lr"], case["momentum"]
    model = torch.zeros(N)
    outer = make_outer(f"delayed-nesterov({lr!r}, {b!r}, {n})", N, round_updates=99)
    ref = torch.nn.Parameter(torch.zeros(N, dtype=torch.float64))
    sgd = torch.optim.SGD([ref], lr=lr, momentum=b, nesterov=True)
    block = torch.zeros(N, dtype=torch.float64)
    for t, (p, w) in enumerate(zip(ups, weights), start=1):
        assert outer.step(model, p, w)
        block += w * p.to_dense().double()
        if t % n == 0:
            ref.grad = -block
            sgd.step()
            block.zero_()
            torch.testing.assert_close(model.double(), ref.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec", ["none", "nesterov(0.7, 0.9)", "delayed-nesterov(0.7, 0.9, 2)"])
@pytest.mark.parametrize("kind", ["dense", "topk"])
def test_a_non_finite_update_writes_nothing(spec, kind):
    outer = make_outer(spec, N, round_updates=2)
    model = torch.zeros(N)
    for p in payloads(1, 3, kind):
        outer.step(model, p, 0.5)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
              for k, v in outer.state_dict().items()}
    saved = model.clone()
    bad = torch.randn(N)
    bad[5] = math.nan
    poisoned = Payload.dense(bad) if kind == "dense" else sparse([1, 5, 30], [0.5, math.nan, 1.0])
    assert poisoned.sparse == (kind == "topk")
    assert not outer.step(model, poisoned, 0.5)
    assert torch.equal(model, saved)
    for k, v in outer.state_dict().items():
        assert torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k]


def test_a_sparse_buffer_index_out_of_range_raises_before_the_parameters_move():
    outer = make_outer("nesterov", N, round_updates=2, params_numel=30)
    model = torch.zeros(N)
    with pytest.raises(IndexError):
        outer.step(model, sparse([3, N + 2], [1.0, 1.0]), 1.0)
    assert torch.equal(model, torch.zeros(N)) and outer.updates == 0


def test_a_sparse_index_out_of_range_raises_and_writes_nothing():
    outer = make_outer("nesterov", N, round_updates=2)
    model = torch.zeros(N)
    outer.step(model, Payload.dense(torch.ones(N)), 0.5)
    p = own(Compression.topk(0.2).compress(torch.randn(N)))
    p.indices[0] = N + 3
    saved, momentum = model.clone(), outer.momentum.clone()
    with pytest.raises(IndexError):
        outer.step(model, p, 1.0)
    assert torch.equal(model, saved) and torch.equal(outer.momentum, momentum)


@pytest.mark.parametrize("spec", ["nesterov(0.5, 0.8)", "delayed-nesterov(0.5, 0.8, 3)"])
def test_state_dict_resumes_the_same_trajectory(spec):
    ups = payloads(7, 10, "dense")
    a, model_a = make_outer(spec, N, 3), torch.zeros(N)
    for p in ups[:4]:
        a.step(model_a, p, 0.3)
    b, model_b = make_outer(spec, N, 3), model_a.clone()
    b.load_state_dict(a.state_dict())
    for p in ups[4:]:
        a.step(model_a, p, 0.3)
        b.step(model_b, p, 0.3)
    assert torch.equal(model_a, model_b)


def test_state_of_another_rule_or_size_is_refused():
    state = make_outer("nesterov(0.7, 0.9)", N, 3).state_dict()
    with pytest.raises(ValueError, match="outer optimizer"):
        make_outer("nesterov(0.5, 0.9)", N, 3).load_state_dict(state)
    with pytest.raises(ValueError, match="outer optimizer"):
        make_outer("nesterov(0.7, 0.9)", N + 1, 3).load_state_dict(state)


@pytest.mark.parametrize("text, spec", [
    ("none", OuterSpec()),
    ("nesterov", OuterSpec("nesterov", 0.7, 0.9)),
    ("nesterov()", OuterSpec("nesterov", 0.7, 0.9)),
    (" nesterov(1, 0) ", OuterSpec("nesterov", 1.0, 0.0)),
    ("delayed-nesterov", OuterSpec("delayed-nesterov", 0.7, 0.9, None)),
    ("delayed-nesterov(0.5, 0.8)", OuterSpec("delayed-nesterov", 0.5, 0.8, None)),
    ("delayed-nesterov(0.5, 0.8, 4)", OuterSpec("delayed-nesterov", 0.5, 0.8, 4)),
])
def test_parse(text, spec):
    assert parse_outer(text) == spec
    assert parse_outer(str(spec)) == spec


@pytest.mark.parametrize("text", ["adam", "none(1)", "nesterov(0.7)", "nesterov(0.7, 0.9, 2)",
                                  "nesterov(x, 0.9)", "nesterov(0, 0.9)", "nesterov(0.7, 1)",
                                  "nesterov(nan, 0.9)", "delayed-nesterov(0.7, 0.9, 0)",
                                  "delayed-nesterov(0.7, 0.9, 1.5)", "nesterov(0.7, -0.1)"])
def test_parse_rejects_with_the_spec_named(text):
    with pytest.raises(ValueError, match="outer_optimizer"):
        parse_outer(text)


@given(st.sampled_from(["nesterov", "delayed-nesterov"]), st.floats(1e-6, 10.0),
       st.floats(0.0, 0.999), st.one_of(st.none(), st.integers(1, 64)))
def test_a_spec_is_written_so_that_it_reads_back_exactly(kind, lr, momentum, n):
    spec = OuterSpec(kind, lr, momentum, n if kind == "delayed-nesterov" else None)
    assert parse_outer(str(spec)) == spec


def test_the_command_lines_check_an_outer_optimizer_in_one_place():
    from ashl.cli import OptionError, check_outer
    assert check_outer("ashl", " nesterov ", "--outer-optimizer") == "nesterov(0.7, 0.9)"
    with pytest.raises(OptionError, match=r"^--outer-optimizer 'x': expected none"):
        check_outer("ashl", "x", "--outer-optimizer 'x'")
    with pytest.raises(OptionError, match="strategy bsp averages gradients"):
        check_outer("bsp", "nesterov", "--outer-optimizer")


def test_delayed_nesterov_n_defaults_to_one_rounds_updates():
    assert make_outer("delayed-nesterov", N, round_updates=4).n == 4
    assert str(make_outer("delayed-nesterov(0.7, 0.9)", N, 4).spec) == "delayed-nesterov(0.7, 0.9, 4)"


@given(sequences, st.integers(0, N), st.sampled_from(["nesterov", "delayed-nesterov"]))
@settings(max_examples=60, deadline=None)
def test_the_rule_moves_the_parameters_and_the_buffers_get_the_plain_merge(case, params, kind):
    """A model of `params` parameter elements then buffers (BatchNorm statistics)."""
    ups, weights = payloads(case["seed"], case["count"], case["kind"]), damped(case)
    lr, b = case["lr"], case["momentum"]
    model = torch.zeros(N)
    outer = make_outer(f"{kind}({lr!r}, {b!r}, 2)" if kind != "nesterov" else
                       f"nesterov({lr!r}, {b!r})", N, round_updates=2, params_numel=params)
    alone = make_outer(outer.spec, params, round_updates=2)     # the parameters by themselves
    head_model, tail_ref = torch.zeros(params), torch.zeros(N - params, dtype=torch.float64)
    for p, w in zip(ups, weights):
        assert outer.step(model, p, w)
        dense = p.to_dense()
        alone.step(head_model, Payload.dense(dense[:params].contiguous()), w)
        tail_ref += w * dense[params:].double()
    torch.testing.assert_close(model[:params], head_model, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[params:].double(), tail_ref, rtol=1e-5, atol=1e-6)
    assert outer.momentum.numel() == params


@pytest.mark.parametrize("kind", ["dense", "topk"])
def test_a_bad_buffer_value_writes_nothing_in_the_parameters_either(kind):
    outer = make_outer("nesterov(0.7, 0.9)", N, round_updates=2, params_numel=30)
    model = torch.zeros(N)
    outer.step(model, Payload.dense(torch.ones(N)), 0.5)
    saved, momentum = model.clone(), outer.momentum.clone()
    bad = torch.ones(N)
    bad[33] = math.inf                                   # a buffer element
    poisoned = Payload.dense(bad) if kind == "dense" else sparse([2, 29, 33], [1.0, 1.0, math.inf])
    assert poisoned.sparse == (kind == "topk")
    assert not outer.step(model, poisoned, 0.5)
    assert torch.equal(model, saved) and torch.equal(outer.momentum, momentum)
    assert outer.updates == 1


@given(st.integers(0, 2 ** 16), st.integers(0, N), st.floats(0.05, 1.0))
def test_split_keeps_every_entry_once(seed, at, ratio):
    delta = torch.randn(N, generator=torch.Generator().manual_seed(seed))
    for p in (Payload.dense(delta), own(Compression.topk(ratio).compress(delta))):
        head, tail = p.split(at)
        assert head.numel == at and tail.numel == N - at
        torch.testing.assert_close(torch.cat([head.to_dense(), tail.to_dense()]), p.to_dense())
        if p.sparse:
            assert head.nnz + tail.nnz == p.nnz


def test_a_checkpoints_outer_state_that_does_not_fit_is_refused_on_every_rank():
    """ServerStrategy.load_checkpoint's check (every rank runs it before any rank starts; the
    server rank alone loads the state later, where a failure would leave the others waiting)."""
    from types import SimpleNamespace
    from ashl.outer_spec import parse_outer
    from ashl.strategies.parameter_server import ServerStrategy
    run = SimpleNamespace(numel=N, params_numel=30, size=3,
                          outer_spec=parse_outer("delayed-nesterov(0.7, 0.5)"))
    check = ServerStrategy._check_outer_state
    good = make_outer(run.outer_spec, N, 3, params_numel=30).state_dict()
    check(run, "c", good)
    for bad, needle in [(None, "trained with outer_optimizer='none'"),
                        (dict(good, spec="nesterov(0.7, 0.9)"), "trained with"),
                        (dict(good, params=N), "does not fit"),
                        (dict(good, momentum=torch.zeros(N)), "does not fit"),
                        ({k: v for k, v in good.items() if k != "updates"}, "does not fit")]:
        with pytest.raises(ValueError, match=needle):
            check(run, "c", bad)
    plain = SimpleNamespace(numel=N, params_numel=30, size=3, outer_spec=parse_outer("none"))
    check(plain, "c", None)      # a checkpoint from before outer optimizers: plain merge


@pytest.mark.parametrize("kind", ["dense", "fp16", "topk"])
def test_the_plain_merge_into_a_second_buffer_gives_the_in_place_bits(monkeypatch, kind):
    """A large host model is merged into a spare buffer that becomes its storage: the same
    bits as the in-place merge, two storages taking turns, and a NaN leaves both alone."""
    in_place = make_outer("none", N, round_updates=2)
    monkeypatch.setattr(PlainMerge, "double_buffer_numel", 1)
    swapping = make_outer("none", N, round_updates=2)
    ref, model = torch.zeros(N), torch.zeros(N)
    storages = set()
    for p, w in zip(payloads(3, 8, kind), [0.5, 0.25, 1.0, 0.75] * 2):
        assert in_place.step(ref, p, w) and swapping.step(model, p, w)
        assert torch.equal(model, ref)
        storages.add(model.data_ptr())
    assert len(storages) == (1 if kind == "topk" else 2)   # sparse merges stay in place
    assert swapping.updates == in_place.updates == 8
    bad = torch.randn(N)
    bad[7] = math.nan
    at, saved = model.data_ptr(), model.clone()
    assert not swapping.step(model, Payload.dense(bad), 0.5)
    assert model.data_ptr() == at and torch.equal(model, saved)
    assert swapping.updates == 8
