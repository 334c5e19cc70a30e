"""ashl.torch.HeterogeneousSampler: planned shares, one permutation per global epoch."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from torch.utils.data import DataLoader, TensorDataset

from ashl.torch import HeterogeneousSampler
from ashl.torch.sampler import padded_counts, shares_to_counts


def samplers(n, shares=None, world=None, **kw):
    world = world or len(shares)
    return [HeterogeneousSampler(range(n), world, r, shares=shares, **kw) for r in range(world)]


def epoch_union(ss, epoch=None):
    out = []
    for s in ss:
        if epoch is not None:
            s.set_epoch(epoch)
        out += list(s)
    return out


@st.composite
def shares_case(draw):
    world = draw(st.integers(1, 8))
    n = draw(st.integers(0, 400))
    kind = draw(st.sampled_from(["float", "fraction", "count", "default"]))
    if kind == "default":
        return n, world, None
    if kind == "count":
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=world - 1, max_size=world - 1)))
        bounds = [0] + cuts + [n]
        return n, world, [bounds[i + 1] - bounds[i] for i in range(world)]
    weights = draw(st.lists(st.integers(0, 100), min_size=world, max_size=world).filter(any))
    if kind == "fraction":
        return n, world, [Fraction(w, sum(weights)) for w in weights]
    return n, world, [w / sum(weights) for w in weights]


# --- properties ---------------------------------------------------------------------------

@given(shares_case(), st.integers(0, 2**31), st.integers(0, 1000), st.booleans())
def test_one_epoch_is_a_permutation(case, seed, epoch, shuffle):
    n, world, shares = case
    ss = samplers(n, shares, world, seed=seed, shuffle=shuffle)
    union = epoch_union(ss, epoch)
    counts = ss[0].counts()
    assert [len(s) for s in ss] == list(counts) and len(union) == sum(counts)
    assert set(union) == set(range(n))                  # every sample read
    if sum(counts) == n:
        assert sorted(union) == list(range(n))          # each sample exactly once, disjoint
    if shares is not None and all(isinstance(x, int) for x in shares):
        assert list(counts) == shares
    if not shuffle:                                     # contiguous slices in rank order
        assert union == (list(range(n)) * (world + 1))[:sum(counts)]


@given(shares_case(), st.integers(0, 1000))
def test_padding_is_distributed_samplers(case, seed):
    """Without drop_last: equal shares give equal counts (DistributedSampler's padding, the
    first samples of the permutation read twice); every rank reads at least one sample."""
    n, world, shares = case
    ss = samplers(n, shares, world, seed=seed)
    counts = ss[0].counts()
    exact = shares_to_counts(shares or [Fraction(1, world)] * world, n, world)
    if shares is not None and all(isinstance(x, int) for x in shares):
        assert counts == exact                          # the user's own counts
        return
    assert counts == padded_counts(exact, n, equal=shares is None or len(set(shares)) == 1)
    if n:
        assert min(counts) >= 1 and sum(counts) - n < world
    if shares is None:
        assert len(set(counts)) == 1
        torch_sampler = torch.utils.data.DistributedSampler(range(n), world, 0, shuffle=False)
        assert counts[0] == len(torch_sampler)


def test_uneven_datasets_are_padded_as_distributed_sampler_pads():
    assert [s.counts() for s in samplers(97, world=3)][0] == (33, 33, 33)
    assert samplers(2, world=3)[2].counts() == (1, 1, 1)
    assert list(samplers(2, world=3, shuffle=False)[2]) == [0]
    assert samplers(10, shares=[0.95, 0.05, 0.0])[0].counts() == (9, 1, 1)
    assert samplers(97, world=3, drop_last=True)[0].counts() == (32, 32, 32)


@given(shares_case())
def test_largest_remainder_counts(case):
    n, world, shares = case
    if shares is None or all(isinstance(x, int) for x in shares):
        return
    counts = shares_to_counts(shares, n, world)
    total = sum(Fraction(x) for x in shares)
    for c, x in zip(counts, shares):
        quota = Fraction(x) / total * n
        assert math.floor(quota) <= c <= math.floor(quota) + 1
    floors = shares_to_counts(shares, n, world, drop_last=True)
    assert all(f <= c for f, c in zip(floors, counts)) and n - sum(floors) < max(world, 1)


@given(st.lists(st.integers(1, 50), min_size=1, max_size=6), st.integers(0, 500))
def test_matches_the_planners_rounding(weights, n):
    planner = pytest.importorskip("ashl.planner")
    shares = [Fraction(w, sum(weights)) for w in weights]
    assert shares_to_counts(shares, n, len(shares)) == tuple(planner.largest_remainder(shares, n))


@given(shares_case(), st.integers(0, 1000))
def test_drop_last_skips_fewer_than_world(case, seed):
    n, world, shares = case
    ss = samplers(n, shares, world, seed=seed, drop_last=True)
    union = epoch_union(ss, 3)
    assert len(set(union)) == len(union) and set(union) <= set(range(n))
    assert n - len(union) < world


def test_deterministic_from_seed_and_epoch():
    a, b = samplers(100, [0.5, 0.5])[0], samplers(100, [0.5, 0.5])[0]
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    b.set_epoch(1)
    assert list(a) == list(b)
    c = HeterogeneousSampler(range(100), 2, 0, shares=[0.5, 0.5], seed=1)
    assert list(c) != list(b)


def test_planned_shares_give_fast_ranks_more():
    ss = samplers(1000, [0.6, 0.3, 0.1])
    assert [len(s) for s in ss] == [600, 300, 100]
    assert shares_to_counts([1 / 3] * 3, 10, 3) == (4, 3, 3)   # ties go to the lower rank
    ss = samplers(10, [1 / 3, 1 / 3, 1 / 3])
    assert [len(s) for s in ss] == [4, 4, 4]   # equal shares padded, as DistributedSampler
    ss = samplers(10, None, world=3)
    assert [len(s) for s in ss] == [4, 4, 4]


def test_accepts_numpy_and_tensors():
    assert shares_to_counts(np.array([3, 7]), 10, 2) == (3, 7)
    assert shares_to_counts(np.array([0.25, 0.75]), 8, 2) == (2, 6)
    # numpy scalars in a list, as a script computes them
    assert shares_to_counts([np.float32(0.25), np.float64(0.75)], 8, 2) == (2, 6)
    assert shares_to_counts([np.int64(3), np.int32(7)], 10, 2) == (3, 7)
    assert shares_to_counts(torch.tensor([0.5, 0.5]), 9, 2) == (5, 4)


# --- plan changes --------------------------------------------------------------------------

def test_set_shares_does_not_touch_running_iteration():
    s = HeterogeneousSampler(range(100), 2, 0, shares=[0.5, 0.5])
    it = iter(s)
    first = [next(it) for _ in range(10)]
    s.set_shares([0.8, 0.2])
    rest = list(it)
    assert first + rest == s.indices(epoch=0) and len(first + rest) == 50
    assert len(s) == 50                      # still this epoch's plan
    s.set_epoch(1)
    assert len(s) == 80 and len(list(s)) == 80


def test_set_shares_without_set_epoch_applies_at_next_iter():
    s = HeterogeneousSampler(range(100), 2, 1, shares=[0.5, 0.5])
    assert len(list(s)) == 50
    s.set_shares([0.8, 0.2])
    assert len(s) == 50
    assert len(list(s)) == 20


def test_set_shares_before_iterating_applies_now():
    s = HeterogeneousSampler(range(100), 2, 0)
    s.set_shares([30, 70])
    assert len(s) == 30 and len(list(s)) == 30


def test_explicit_epoch_keeps_ranks_consistent():
    """Ranks learn of a plan at different epochs; an explicit epoch switches them together."""
    ss = samplers(90, [1 / 3] * 3)
    ss[0].set_epoch(4)
    list(ss[0])                                # rank 0 is already reading epoch 4
    for s in ss:
        s.set_shares([0.5, 0.25, 0.25], epoch=5)
    assert [s.counts(4) for s in ss] == [(30, 30, 30)] * 3
    assert [s.counts(5) for s in ss] == [(45, 23, 22)] * 3
    for e in (4, 5, 9):
        assert sorted(epoch_union(ss, e)) == list(range(90))
    ss[1].set_shares([0.2, 0.2, 0.6], epoch=7)
    ss[1].set_shares([0.4, 0.4, 0.2], epoch=6)   # the latest call wins for later epochs
    assert ss[1].counts(7) == (36, 36, 18) and ss[1].counts(5) == (45, 23, 22)


def test_shares_come_late_only_when_they_change_a_pass_already_read():
    s = HeterogeneousSampler(range(90), 3, 0)
    s.set_epoch(4)
    assert not s.comes_late([0.5, 0.25, 0.25], 4)      # epoch 4 not begun yet
    list(s)                                            # reading epoch 4 with 30 each
    assert s.comes_late([0.5, 0.25, 0.25], 4)
    assert not s.comes_late([Fraction(1, 3)] * 3, 4)   # the same counts: nothing changes
    assert not s.comes_late([0.5, 0.25, 0.25], 5)
    s.set_shares([0.5, 0.25, 0.25], epoch=5)
    s.set_epoch(7)                                     # epochs 5 and 6 skipped, never read
    assert not s.comes_late([0.2, 0.2, 0.6], 5)
    list(s)
    assert s.comes_late([0.2, 0.2, 0.6], 5) and not s.comes_late([0.5, 0.25, 0.25], 5)
    s.set_shares([0.2, 0.2, 0.6])     # read again in the same epoch, with other counts
    list(s)
    assert s.comes_late([0.2, 0.2, 0.6], 7) and s.comes_late([0.5, 0.25, 0.25], 7)


def test_a_replacement_forgets_the_passes_it_read_alone():
    s = HeterogeneousSampler(range(90), 1, 0)
    s.set_epoch(3)
    list(s)                                            # alone: (90,)
    s.rebind(1, 3)                                     # takes a lost rank's slot
    assert not s.comes_late([Fraction(1, 3)] * 3, 3)


def test_dataloader_reads_its_share():
    ds = TensorDataset(torch.arange(40).float())
    s = HeterogeneousSampler(ds, 2, 1, shares=[0.75, 0.25], seed=3)
    got = torch.cat([b[0] for b in DataLoader(ds, batch_size=4, sampler=s)]).long().tolist()
    assert got == s.indices() and len(got) == 10


def test_defaults_come_from_horovod_then_mpi(monkeypatch):
    import sys
    import types
    mpi = types.SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False,
                                COMM_WORLD=types.SimpleNamespace(Get_size=lambda: 4, Get_rank=lambda: 3))
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    monkeypatch.delitem(sys.modules, "horovod.torch", raising=False)
    s = HeterogeneousSampler(range(10))
    assert (s.num_replicas, s.rank) == (4, 3)
    hvd = types.SimpleNamespace(is_initialized=lambda: True, size=lambda: 2, rank=lambda: 1)
    monkeypatch.setitem(sys.modules, "horovod.torch", hvd)
    s = HeterogeneousSampler(range(10))
    assert (s.num_replicas, s.rank) == (2, 1)
    s = HeterogeneousSampler(range(10), num_replicas=5, rank=4)   # explicit wins
    assert (s.num_replicas, s.rank) == (5, 4)
    hvd.is_initialized = lambda: False
    assert HeterogeneousSampler(range(10)).num_replicas == 4       # falls through to MPI


def test_defaults_without_mpi_or_horovod(monkeypatch):
    import sys
    monkeypatch.delitem(sys.modules, "horovod.torch", raising=False)
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    s = HeterogeneousSampler(range(10))  # no initialised world here: one rank reads everything
    assert s.num_replicas == 1 and s.rank == 0 and sorted(s) == list(range(10))


# --- validation --------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(num_replicas=0, rank=0), "num_replicas"),
    (dict(num_replicas=2, rank=2), "rank"),
    (dict(num_replicas=2, rank=-1), "rank"),
    (dict(num_replicas=2.0, rank=0), "num_replicas"),
    (dict(num_replicas=2, rank=0, shares=[1.0]), "2 ranks"),
    (dict(num_replicas=2, rank=0, shares=[0.5, 0.6]), "sum to 1"),
    (dict(num_replicas=2, rank=0, shares=[0.0, 0.0]), "sum to 1"),
    (dict(num_replicas=2, rank=0, shares=[1.5, -0.5]), ">= 0"),
    (dict(num_replicas=2, rank=0, shares=[math.nan, 1.0]), ">= 0"),
    (dict(num_replicas=2, rank=0, shares=[math.inf, 1.0]), ">= 0"),
    (dict(num_replicas=2, rank=0, shares=[3, 3]), "dataset size 10"),
    (dict(num_replicas=2, rank=0, shares=["a", "b"]), "not a number"),
    (dict(num_replicas=2, rank=0, shares=[True, False]), "not a number"),
    (dict(num_replicas=2, rank=0, shares="ab"), "list"),
    (dict(num_replicas=2, rank=0, seed=1.5), "seed"),
])
def test_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        HeterogeneousSampler(range(10), **kw)


def test_rejects_bad_epochs_and_datasets():
    s = HeterogeneousSampler(range(10), 2, 0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="epoch"):
            s.set_epoch(bad)
        with pytest.raises(ValueError, match="epoch"):
            s.set_shares([0.5, 0.5], epoch=bad)
    with pytest.raises(ValueError, match="sum to 1"):
        s.set_shares([0.9, 0.9])
    assert s.counts() == (5, 5)               # a rejected plan changes nothing
    with pytest.raises(ValueError, match="length"):
        HeterogeneousSampler(iter(range(3)), 1, 0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_end_of_a_pass_is_announced_once_inside_the_loop(num_workers):
    data = TensorDataset(torch.arange(40))
    s = HeterogeneousSampler(data, num_replicas=2, rank=0, shares=[Fraction(3, 4), Fraction(1, 4)])
    events = []
    s.on_iteration(lambda: events.append("begin"))
    s.on_exhausted(lambda: events.append("end"))
    loader = DataLoader(data, batch_size=7, sampler=s,
                        num_workers=num_workers)
    for epoch in range(2):
        s.set_epoch(epoch)
        for _ in loader:
            events.append("batch")
        events.append("loop over")
    # 30 indices, batches of 7: the end comes once per pass, before the loop is over (with
    # workers the loader has read ahead, so it comes earlier)
    for begin in (0, events.index("loop over") + 1):
        epoch = events[begin:events.index("loop over", begin) + 1]
        assert epoch[0] == "begin" and epoch.count("end") == 1 and epoch.count("batch") == 5
        assert epoch.index("end") < len(epoch) - 1
    it = iter(s)                                   # a pass abandoned early: no end
    next(it)
    del it
    assert events.count("end") == 2


def test_the_shares_schedule_survives_a_checkpoint():
    s = HeterogeneousSampler(range(90), 3, 1)
    s.set_shares([0.5, 0.25, 0.25], epoch=2)
    s.set_epoch(4)
    list(s)                                       # epoch 4 begun: new shares wait for 5
    s.set_shares([0.2, 0.2, 0.6])
    state = s.state_dict()
    fresh = HeterogeneousSampler(range(90), 3, 1)
    fresh.load_state_dict(state)
    assert [fresh.counts(e) for e in range(7)] == \
        [(30, 30, 30)] * 2 + [(45, 23, 22)] * 3 + [(18, 18, 54)] * 2
    assert [fresh.counts(e) for e in range(7)] == [s.counts(e) if e < 5 else (18, 18, 54)
                                                  for e in range(7)]
    fresh.set_epoch(4)                            # the loop resumes epoch 4: as it began
    assert len(fresh) == 23 and fresh.indices() == s.indices(epoch=4)


def test_a_schedule_for_another_dataset_or_world_is_refused():
    state = HeterogeneousSampler(range(90), 3, 1).state_dict()
    with pytest.raises(ValueError, match="for 90 samples on 3 ranks; this sampler has 80 on 3"):
        HeterogeneousSampler(range(80), 3, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="this sampler has 90 on 2"):
        HeterogeneousSampler(range(90), 2, 1).load_state_dict(state)
