"""What a converted Horovod script passes: hvd.DistributedOptimizer's keywords, and
DistributedSampler's signature (each honoured, or refused with a message naming it)."""
import inspect
import warnings

import horovod.torch as hvd
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

import ashl.torch as ashl
from ashl.stages import StageConfig
from ashl.torch.horovod_keywords import HorovodKeywords

from fake_world import FakeWorld


def build(comm, fake_hvd, strategy="localsgd", **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, ashl.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            strategy=strategy, comm=comm, hvd=fake_hvd, **kw)


def test_the_signature_is_horovods_in_horovods_order():
    ours = list(inspect.signature(ashl.DistributedOptimizer).parameters)
    theirs = list(inspect.signature(hvd.DistributedOptimizer).parameters)
    assert ours[:len(theirs)] == theirs
    ours = list(inspect.signature(ashl.HeterogeneousSampler).parameters)
    theirs = list(inspect.signature(DistributedSampler).parameters)
    assert ours[:len(theirs)] == theirs


def test_the_sampler_takes_distributed_samplers_arguments_positionally():
    s = ashl.HeterogeneousSampler(range(10), 2, 1, False, 7, True)
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last) == (2, 1, False, 7, True)
    assert list(s) == list(range(5, 10))          # no shuffle: the second half
    # as DistributedSampler: the ranks' parts are disjoint, the same size, and cover the data
    other = ashl.HeterogeneousSampler(range(10), 2, 0, False, 7, True)
    theirs = [set(DistributedSampler(range(10), 2, r, shuffle=False)) for r in (0, 1)]
    assert set(other) | set(s) == theirs[0] | theirs[1] == set(range(10))
    assert len(other) == len(s) == len(theirs[0]) == 5 and not set(other) & set(s)


@pytest.mark.parametrize("keywords", [
    dict(op=hvd.Average), dict(compression=hvd.Compression.none),
    dict(backward_passes_per_step=4), dict(gradient_predivide_factor=1.0),
    dict(num_groups=0, groups=None), dict(sparse_as_dense=True)])
def test_keywords_a_delta_strategy_honours(keywords):
    def rank_fn(comm, fake_hvd):
        _, opt = build(comm, fake_hvd, local_steps=1, stage_config=StageConfig(max_commits=2),
                       **keywords)
        opt.finish()
        return opt.strategy.backward_passes_per_step
    assert FakeWorld(1).run(rank_fn) == [keywords.get("backward_passes_per_step", 1)]


@pytest.mark.parametrize("keywords,needle", [
    (dict(op=hvd.Adasum), "op=Adasum: strategy 'localsgd' merges model deltas as a weighted average"),
    (dict(op=hvd.Sum), "op=Sum"),
    (dict(gradient_predivide_factor=2.0), "gradient_predivide_factor=2.0: strategy 'localsgd' has no gradient sum"),
    (dict(num_groups=2), "always sends the whole model in one fused buffer"),
    (dict(groups=[[]]), "always sends the whole model in one fused buffer"),
    (dict(process_set=object()), "the global process set"),
    (dict(backward_passes_per_step=0), "backward_passes_per_step must be an integer >= 1"),
    (dict(compression=hvd.Compression.fp16), "cannot send with compression=Compression.fp16"),
])
def test_keywords_that_have_no_meaning_are_refused_by_name(keywords, needle):
    def rank_fn(comm, fake_hvd):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            build(comm, fake_hvd, **keywords)
        return True
    assert FakeWorld(1).run(rank_fn) == [True]


def test_bsp_gets_horovods_keywords_untouched():
    kw = HorovodKeywords(backward_passes_per_step=2, op=hvd.Adasum, gradient_predivide_factor=2.0,
                         num_groups=3).for_horovod()
    assert kw == {"backward_passes_per_step": 2, "gradient_predivide_factor": 2.0,
                  "num_groups": 3, "groups": None, "sparse_as_dense": False, "op": hvd.Adasum}


def test_bsp_refuses_adasum_where_horovod_would_build_its_adasum_optimizer(monkeypatch):
    """(alike on every rank, before Horovod builds it: raised on each, not an abort)"""
    from ashl.torch.optimizer import _check_horovod_allreduces
    monkeypatch.setattr(hvd, "size", lambda: 2)
    with pytest.raises(RuntimeError, match="not Adasum"):
        _check_horovod_allreduces(HorovodKeywords(op=hvd.Adasum))
    _check_horovod_allreduces(HorovodKeywords(op=hvd.Sum))
    monkeypatch.setattr(hvd, "size", lambda: 1)      # Horovod's allreduce optimizer alone
    _check_horovod_allreduces(HorovodKeywords(op=hvd.Adasum))


def test_finished_is_an_error_where_nothing_can_end_the_run_and_a_step_after_the_end_is_a_no_op():
    def rank_fn(comm, fake_hvd):
        model, opt = build(comm, fake_hvd, local_steps=1)           # no target, no budget
        with pytest.raises(ValueError, match="no target and no budget"):
            _ = opt.finished
        opt.finish()
        assert opt.finished                                          # after the end: fine
        # an accuracy target that nothing measures cannot end the run either
        model, opt = build(comm, fake_hvd, local_steps=1,
                           stage_config=StageConfig(target_accuracy=0.9))
        with pytest.raises(ValueError, match="no target and no budget"):
            _ = opt.finished
        opt.finish()
        model, opt = build(comm, fake_hvd, local_steps=1, stage_config=StageConfig(max_commits=1))
        loss = model(torch.ones(1, 3)).sum()
        loss.backward()
        opt.step()
        assert opt.finished
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()                                                   # after the run: nothing moves
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt.finish()
        return True
    assert FakeWorld(1).run(rank_fn) == [True]


def test_sys_exit_with_a_failure_status_is_noted_for_the_exit_hook(monkeypatch):
    from ashl.torch import exit as exit_hook
    monkeypatch.setattr(exit_hook, "_failure", [])
    exits = []
    wrapped = exit_hook._recording_exit(lambda status=None: exits.append(status))
    wrapped()
    wrapped(0)
    assert exit_hook._failure == [] and exits == [None, 0]      # a normal end
    wrapped(3)
    assert exits[-1] == 3 and [f.code for f in exit_hook._failure] == [3]


def named_case(case):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = {"parameters": model.parameters(),
             "subset": model[0].named_parameters(),
             "duplicates": [("w", model[0].weight), ("w", model[0].bias)]
                           + list(model[1].named_parameters())}[case]
    return model, opt, named


@pytest.mark.parametrize("case,needle", [
    ("parameters", "named_parameters should be a sequence of (name, parameter) tuples"),
    ("subset", "named_parameters was given, but 2 of the optimizer's parameters are not in it"),
    ("duplicates", "parameter names in named_parameters must be unique; found duplicates: w"),
])
def test_named_parameters_are_checked_as_horovod_checks_them(case, needle):
    """A parameter left out of named_parameters would never travel: the ranks' copies would
    drift apart with no error."""
    def rank_fn(comm, fake_hvd):
        _, opt, named = named_case(case)
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            ashl.DistributedOptimizer(opt, named_parameters=named, strategy="localsgd",
                                      comm=comm, hvd=fake_hvd)
        return True
    assert FakeWorld(1).run(rank_fn) == [True]


def test_an_optimizer_parameter_outside_model_is_refused():
    def rank_fn(comm, fake_hvd):
        model = torch.nn.Linear(3, 2)
        loss_weight = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([*model.parameters(), loss_weight], lr=0.1)
        with pytest.raises(ValueError, match=r"1 of the optimizer's parameters \(positions \[2\] "
                                             r"in its param_groups\) are not parameters of model="):
            ashl.DistributedOptimizer(opt, model=model, strategy="localsgd", comm=comm,
                                      hvd=fake_hvd)
        return True
    assert FakeWorld(1).run(rank_fn) == [True]


@pytest.mark.parametrize("first", ["ashl", "horovod"])
def test_an_optimizer_wrapped_already_is_refused(first):
    """A hand conversion that keeps hvd.DistributedOptimizer and adds ashl's: both call
    super(self.__class__, self), which would recurse for ever at the first step."""
    def rank_fn(comm, fake_hvd):
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if first == "ashl":
            inner = ashl.DistributedOptimizer(opt, model=model, strategy="localsgd", comm=comm,
                                              hvd=fake_hvd, stage_config=StageConfig(max_commits=1))
        else:   # Horovod's class, as hvd.DistributedOptimizer builds it (no hvd.init here)
            from horovod.torch.optimizer import _DistributedOptimizer
            cls = type("SGD", (torch.optim.SGD,), dict(_DistributedOptimizer.__dict__))
            inner = cls.__new__(cls)
            inner.__dict__.update(opt.__dict__)
        with pytest.raises(ValueError, match="optimizer is a distributed optimizer already"):
            ashl.DistributedOptimizer(inner, model=model, strategy="localsgd", comm=comm,
                                      hvd=fake_hvd)
        if first == "ashl":
            inner.finish()
        return True
    assert FakeWorld(1).run(rank_fn) == [True]


@pytest.mark.parametrize("strategy", ["bsp", "localsgd"])
def test_a_misspelled_option_is_refused_by_every_strategy(strategy):
    def rank_fn(comm, fake_hvd):
        with pytest.raises(TypeError, match="unexpected keyword argument 'evalute'"):
            build(comm, fake_hvd, strategy=strategy, evalute=None)
        return True
    assert FakeWorld(1).run(rank_fn) == [True]


def test_an_lr_scheduler_built_before_wrapping_leaves_step_to_ashl():
    """torch's scheduler puts a wrapper of the old object's step() in its __dict__, which the
    wrapped optimizer shares: it must not bypass ashl's step (the lr still follows)."""
    def rank_fn(comm, fake_hvd):
        model = torch.nn.Linear(3, 1)
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(base, step_size=2, gamma=0.5)
        opt = ashl.DistributedOptimizer(base, model=model, strategy="localsgd", local_steps=2,
                                        comm=comm, hvd=fake_hvd,
                                        stage_config=StageConfig(max_commits=3))
        while not opt.finished:
            opt.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
            with warnings.catch_warnings():   # the old object never stepped (as with Horovod)
                warnings.simplefilter("ignore", UserWarning)
                sched.step()
        counters = opt.counters()
        opt.finish()
        return counters["local_steps"], counters["commits"], opt.param_groups[0]["lr"]
    assert FakeWorld(1).run(rank_fn) == [(6, 3, 0.1 * 0.5 ** 3)]


@pytest.mark.parametrize("strategy", ["bsp", "localsgd"])
def test_an_option_switched_off_passes_for_a_strategy_without_it(strategy, monkeypatch):
    """`ashl.train --no-overlap` passes overlap=False whatever the strategy."""
    monkeypatch.setenv("ASHL_STAGE_WIRE", "1")   # bsp: ashl's own optimizer on FakeHorovod
    def rank_fn(comm, fake_hvd):
        _, opt = build(comm, fake_hvd, strategy=strategy, overlap=False, fault_tolerant=False,
                       outer_optimizer=None, stage_config=StageConfig(max_commits=1))
        opt.finish()
        return True
    assert FakeWorld(1).run(rank_fn) == [True]


def test_broadcast_parameters_takes_what_horovods_takes_and_names_anything_else():
    from ashl.torch.functions import _named_items
    w, b = torch.zeros(2, 3), torch.ones(2)
    assert _named_items({"w": w, "b": b}) == [("b", b), ("w", w)]     # a state_dict, sorted
    assert _named_items([w, ("b", b)]) == [(None, w), ("b", b)]      # bare parameters too
    for bad in ([["w", w]], [("w", w, 1)], [("w", 3)]):               # would broadcast nothing
        with pytest.raises(ValueError, match="expected \\(name, tensor\\) pairs or tensors"):
            _named_items(bad)
    with pytest.raises(ValueError, match="got Tensor"):
        _named_items(w)
