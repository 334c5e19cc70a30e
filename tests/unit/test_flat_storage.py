"""A model stored flat: FlatTensors found and made, every kernel giving the same bits on them as
on the separate tensors, and store_flat re-homing a real model without changing what it
computes or how its optimizer steps."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ashl.kernels as K
from ashl.kernels import FlatTensors
from ashl.strategies.model_state import model_state, store_flat


def flat_list(shapes, seed=0, dtype=torch.float32):
    """FlatTensors over a new buffer of random values, viewed as `shapes`."""
    g = torch.Generator().manual_seed(seed)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    flat = torch.randn(sum(numels), generator=g).to(dtype)
    views, off = [], 0
    for s, n in zip(shapes, numels):
        views.append(flat[off:off + n].view(s))
        off += n
    found = FlatTensors.of(views)
    assert found is not None
    return found


def separate(tensors):
    """The same values as separate tensors (a plain list)."""
    return [t.clone() for t in tensors]


SHAPES = [(3, 4), (5,), (1,), (2, 2, 2), (4099,)]
shape_lists = st.lists(st.tuples(st.integers(1, 9), st.integers(1, 70)), min_size=1, max_size=12)


def test_views_back_to_back_in_one_storage_are_found():
    ft = flat_list(SHAPES)
    assert ft.numels == (12, 5, 1, 8, 4099)
    assert ft.flat.numel() == sum(ft.numels) and ft.flat.data_ptr() == ft[0].data_ptr()
    base = torch.zeros(40)
    inner = FlatTensors.of([base[10:14], base[14:20]])   # an offset into a larger storage
    assert inner is not None and inner.flat.data_ptr() == base[10:].data_ptr()
    inner.flat.fill_(1.0)
    assert base.sum() == 10 and base[10:20].eq(1).all()


@pytest.mark.parametrize("case", ["gap", "order", "dtype", "separate", "strided", "empty list"])
def test_anything_else_is_not(case):
    base = torch.zeros(20)
    tensors = {
        "gap": [base[0:4], base[5:9]],
        "order": [base[4:8], base[0:4]],
        "dtype": [base[0:4], base[4:8].to(torch.float16)],
        "separate": [torch.zeros(4), torch.zeros(4)],
        "strided": [base[0:8].view(2, 4).t(), base[8:12]],
        "empty list": [],
    }[case]
    assert FlatTensors.of(tensors) is None


def test_a_clone_is_flat_laid_out_alike_and_apart():
    ft = flat_list(SHAPES, seed=1)
    c = K.clone_tensors(ft)
    assert isinstance(c, FlatTensors) and c.numels == ft.numels
    assert c.flat.data_ptr() != ft.flat.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(c, ft))
    plain = K.clone_tensors(list(ft))
    assert type(plain) is list and all(torch.equal(a, b) for a, b in zip(plain, ft))


@settings(max_examples=25, deadline=None)
@given(shapes=shape_lists, seed=st.integers(0, 2 ** 16))
def test_every_kernel_gives_the_bits_of_the_separate_tensors(shapes, seed):
    p, a, r = flat_list(shapes, seed), flat_list(shapes, seed + 1), flat_list(shapes, seed + 2)
    n = p.flat.numel()
    out_flat, out_list = torch.empty(n), torch.empty(n)
    K.pack_delta(p, a, out_flat, 0.5, r)
    K.pack_delta(separate(p), separate(a), out_list, 0.5, separate(r))
    assert torch.equal(out_flat, out_list)

    for op in (K.unpack_assign, K.unpack_add):
        p2, a2 = K.clone_tensors(p), K.clone_tensors(a)
        p3, a3 = separate(p), separate(a)
        op(p2, a2, out_flat)
        op(p3, a3, out_flat)
        assert all(torch.equal(x, y) for x, y in zip(list(p2) + list(a2), p3 + a3))

    d1, d2 = K.clone_tensors(p), separate(p)
    assert K.merge_dense(d1, a, 0.3) and K.merge_dense(d2, separate(a), 0.3)
    assert all(torch.equal(x, y) for x, y in zip(d1, d2))
    into = K.clone_tensors(p)
    assert K.merge_dense(p, a, 0.3, out=into)
    assert all(torch.equal(x, y) for x, y in zip(into, d2))

    w1, w2 = K.clone_tensors(p), separate(p)
    K.weighted_sum(w1, [a, r], [0.25, 0.75])
    K.weighted_sum(w2, [separate(a), separate(r)], [0.25, 0.75])
    assert all(torch.equal(x, y) for x, y in zip(w1, w2))


def test_lists_laid_out_otherwise_are_checked_tensor_by_tensor():
    """Same total, other shapes: the flat buffers would pair, the tensors do not."""
    p, a = flat_list([(3,), (5,)]), flat_list([(5,), (3,)])
    with pytest.raises(ValueError, match=r"anchors\[0\] has 5 elements but params\[0\] has 3"):
        K.pack_delta(p, a, torch.empty(8))
    # a flat list beside a plain one: the plain path, same result
    out = torch.empty(8)
    K.pack_delta(p, separate(p), out)
    assert out.eq(0).all()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_store_flat_keeps_the_model_its_values_and_its_optimizer():
    torch.manual_seed(0)
    model, twin = Net(), Net()
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    assert store_flat(model, params) is None
    assert all(p is q for p, q in zip(params, model.parameters()))   # the same Parameters
    names, tensors = model_state(model, params)
    assert isinstance(tensors, FlatTensors)
    assert names[-2:] == ["bn.running_mean", "bn.running_var"]
    for name, t in zip(names, tensors):
        assert torch.equal(t, twin.state_dict()[name])
    x = torch.randn(8, 1, 8, 8)
    for m, o in ((model, opt), (twin, opt_twin)):
        for _ in range(3):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for (n, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), n
    # the kernels write the model through the flat buffer
    tensors.flat.zero_()
    assert all(p.eq(0).all() for p in model.parameters()) and model.bn.running_var.eq(0).all()
    assert store_flat(model, params) == "stored flat already"


def test_store_flat_leaves_what_it_cannot_store_as_it_is():
    def refused(model, params, why):
        before = [t.data_ptr() for t in [*params, *(model.buffers() if model else [])]]
        assert store_flat(model, params) == why
        assert [t.data_ptr() for t in [*params, *(model.buffers() if model else [])]] == before

    mixed = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3).half())
    refused(mixed, list(mixed.parameters()), "its tensors differ in dtype or device")
    double = torch.nn.Linear(3, 3).double()
    refused(double, list(double.parameters()), "a tensor is empty or not fp32, fp16 or bf16")
    shared = torch.nn.Linear(4, 4)
    view = torch.nn.Parameter(shared.weight.data[0])   # a view of another parameter
    refused(None, [shared.weight, view], "a tensor is a view of a larger storage")
    refused(None, [shared.weight, shared.weight], "a parameter is listed twice")
    # two Parameter objects over one storage (the old tying idiom): each owns it whole
    enc, dec = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    dec.weight.data = enc.weight.data
    tied = torch.nn.ModuleDict({"enc": enc, "dec": dec})
    refused(tied, list(tied.parameters()), "two of its tensors share memory")
    # a buffer over a parameter's storage, which does not travel itself
    net = torch.nn.Linear(4, 4)
    net.register_buffer("alias", net.bias.data)
    refused(net, list(net.parameters()), "two of its tensors share memory")


def test_the_default_stores_a_cpu_model_flat_but_not_for_bsp():
    from ashl.torch import optimizer as api
    for strategy, expected in (("ashl", True), ("bsp", False)):
        model = Net()
        api._store_flat(model, list(model.parameters()), strategy, None)
        _, tensors = model_state(model, list(model.parameters()))
        assert isinstance(tensors, FlatTensors) == expected
    model = Net()
    api._store_flat(model, list(model.parameters()), "bsp", True)   # asked for
    assert isinstance(model_state(model, list(model.parameters()))[1], FlatTensors)
    with pytest.raises(ValueError, match="flat_storage must be True, False or None"):
        api._store_flat(model, list(model.parameters()), "ashl", "yes")


def test_flat_tensors_pickle_and_copy_as_views_of_one_buffer():
    import copy
    ft = flat_list(SHAPES, seed=3)
    for twin in (copy.deepcopy(ft), torch.load(_saved(ft), weights_only=False)):
        assert isinstance(twin, FlatTensors) and twin.numels == ft.numels
        assert all(torch.equal(a, b) for a, b in zip(twin, ft))
        twin.flat.zero_()
        assert all(t.eq(0).all() for t in twin) and not ft.flat.eq(0).all()
    shallow = copy.copy(ft)
    assert shallow.flat is ft.flat and isinstance(shallow, FlatTensors)


def _saved(obj):
    import io
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
