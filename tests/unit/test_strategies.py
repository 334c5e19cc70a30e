"""The strategies' control plane on an in-process fake world (fake_world.py): N ranks in
threads, a real model and optimizer, the real strategy classes, no mpirun."""
import copy
import math
import re
import threading
import time

import pytest
import torch

import ashl.torch as ashl
from ashl.compression import Compression, Residual
from ashl.coordinator import DriftConfig
from ashl.stages import StageConfig
from ashl.strategies import make_strategy
from ashl.strategies.base import ProfileBarrier, Strategy
from ashl.strategies.control import ControlSlots, decide, left_early_reason
from ashl.stages import Stage, StageMachine

from ashl.torch.optimizer import _strategy_options
from fake_world import FakeWorld


# The global RNG is the process's: ranks in threads seed and draw under one lock, or one
# rank's draws land between another's seed and its model (different initial models).
_SEEDED = threading.Lock()


def model_and_data(rank: int, seed: int = 0):
    with _SEEDED:
        torch.manual_seed(seed)                   # the same initial model on every rank
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
    return model, x, y


def train(opt, model, x, y, max_steps=400, leave_after=None):
    """The user's loop; `leave_after` steps: this rank calls finish() early."""
    steps = 0
    while not opt.finished and steps < max_steps:
        i = (steps * 8) % 64
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8])
        loss.backward()
        opt.step(loss=loss)
        steps += 1
        if leave_after is not None and steps >= leave_after:
            break
    opt.finish()
    flat = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()
                      if t.is_floating_point()])
    return {"flat": flat, "counters": opt.counters(), "stage": opt.stage,
            "transitions": opt.strategy.transitions, "plan": opt.plan}


def wrapped(strategy, comm, hvd, model, **config):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if hvd is not None:
        config["hvd"] = hvd
    return ashl.DistributedOptimizer(opt, model=model, strategy=strategy, comm=comm, **config)


@pytest.mark.parametrize("strategy", ["localsgd", "ashl-sync"])
def test_the_first_round_ends_within_the_first_pass(strategy):
    """Passes shorter than the first round (the profile, or H): every rank ends that round,
    and makes the plan, at its pass's end at the latest, so none is still in the round's
    collectives when another is in the script's code between epochs (its metrics'
    allreduce: a deadlock under Horovod)."""
    def rank_fn(comm, hvd):
        rank = comm.Get_rank()
        model, x, y = model_and_data(rank)
        sampler = ashl.HeterogeneousSampler(range(8), 3, rank, shares=[0.5, 0.25, 0.25],
                                            shuffle=False)
        extra = {"profile_steps": 10} if strategy == "ashl-sync" else {"local_steps": 8}
        opt = wrapped(strategy, comm, hvd, model, sampler=sampler, eval_every_s=0, **extra)
        seen = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for i in sampler:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[2 * i:2 * i + 2]), y[2 * i:2 * i + 2]).backward()
                opt.step()
            seen.append((opt.strategy.planned, opt.counters()["commits"]))
            hvd.allreduce_(torch.zeros(1), name="metric")
        opt.finish()
        return seen

    for seen in FakeWorld(3).run(rank_fn):
        assert seen[0][0] is True and seen[0][1] >= 1, seen


def test_a_strategy_that_sizes_shares_warns_without_a_heterogeneous_sampler():
    def rank_fn(comm, hvd):
        model = torch.nn.Linear(2, 1)
        distributed = torch.utils.data.DistributedSampler(range(8), 1, 0)
        with pytest.warns(UserWarning, match="sampler= is a DistributedSampler, not an ashl"):
            wrapped("ashl-sync", comm, hvd, model, sampler=distributed).finish()
        with pytest.warns(UserWarning, match="no sampler= was given"):
            wrapped("ashl-sync", comm, hvd, model).finish()
        return True

    assert FakeWorld(1).run(rank_fn) == [True]


@pytest.mark.parametrize("strategy", ["localsgd", "ashl-sync"])
def test_every_rank_ends_with_the_same_model_after_the_same_rounds(strategy):
    def rank_fn(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        extra = {"profile_steps": 3} if strategy == "ashl-sync" else {"local_steps": 2}
        opt = wrapped(strategy, comm, hvd, model, eval_every_s=0,
                      stage_config=StageConfig(max_commits=12), **extra)
        return train(opt, model, x, y)

    results = FakeWorld(3).run(rank_fn)
    for r in results:
        assert torch.equal(r["flat"], results[0]["flat"])
        assert r["counters"]["commits"] == 4                  # 12 commits = 4 rounds x 3 ranks
        assert r["counters"]["global_commits"] == 12
        assert r["counters"]["stop_reason"].startswith("commit budget")
        assert r["transitions"] == results[0]["transitions"]
        assert r["stage"] == "DONE"
    if strategy == "ashl-sync":
        assert all(r["plan"] == results[0]["plan"] for r in results)


def test_the_first_rank_through_its_profiling_steps_keeps_stepping_until_the_last_is():
    """ProfileBarrier (ashl, async-localsgd): entered after a rank's own profiling steps, it
    lets nobody through before every rank is in; a rank that never tested it (one that
    stopped early) passes with wait()."""
    rank0_stepping = threading.Event()

    def rank_fn(comm, hvd):
        barrier = ProfileBarrier(comm.Dup())
        if comm.Get_rank() == 0:
            steps = 0
            while not barrier.arrived():
                steps += 1
                if steps == 5:
                    rank0_stepping.set()       # only now is rank 1 done profiling
                time.sleep(0.01)
            return steps
        assert rank0_stepping.wait(10)
        barrier.wait()
        return barrier.arrived()

    steps, passed = FakeWorld(2).run(rank_fn)
    assert steps >= 5 and passed is True


def test_the_profiling_lasts_about_as_long_as_the_fastest_ranks_steps():
    """A rank still profiling stops at its third step once another has taken all ten: an x8
    rank no longer profiles eight times as long while the others train on alone."""
    def rank_fn(comm, hvd):
        barrier = ProfileBarrier(comm.Dup())
        factor = (1, 2, 8)[comm.Get_rank()]
        steps = 0
        while not (barrier.enough(steps, 10) and barrier.arrived()):
            time.sleep(0.01 * factor)
            steps += 1
        time.sleep(0.05)
        # every rank's word that it was done is taken: nothing is left in a mailbox
        return steps, barrier.heard, all(q.empty() for q in barrier.comm.group.boxes.values())

    (fast, _, e0), (middle, _, e1), (slow, heard, e2) = FakeWorld(3).run(rank_fn)
    assert fast >= 10 and heard
    assert 3 <= slow < 10 and slow <= middle <= fast
    assert e0 and e1 and e2


def test_a_rank_alone_or_all_in_lockstep_profile_their_whole_count():
    def rank_fn(comm, hvd):
        barrier = ProfileBarrier(comm.Dup())
        steps = 0
        while not (barrier.enough(steps, 6) and barrier.arrived()):
            time.sleep(0.005)
            steps += 1
        return steps

    assert FakeWorld(1).run(rank_fn) == [6]
    assert min(FakeWorld(2).run(rank_fn)) >= 3


class _SteppingOn(Strategy):
    """A profiled strategy whose ranks step on while the others profile (as ashl's)."""
    profiled = True
    steps_while_others_profile = True


def test_stepping_on_while_profiling_keeps_to_the_pass_unless_the_script_opts_out():
    """Within the pass (default): only with a sampler that says where a pass ends, which
    then calls the strategy there; profile_within_epoch=False: with any sampler, no hook."""
    def rank_fn(comm, hvd):
        model = torch.nn.Linear(2, 1)
        params = list(model.parameters())
        sampler = ashl.HeterogeneousSampler(list(range(8)), num_replicas=1, rank=0)
        within = _SteppingOn(model, params, comm=comm, sampler=sampler)
        hooks = len(sampler._on_exhausted)
        across = _SteppingOn(model, params, comm=comm, sampler=sampler,
                             profile_within_epoch=False)
        unknown_pass = _SteppingOn(model, params, comm=comm, sampler=None)
        with pytest.raises(ValueError, match="profile_within_epoch must be True or False"):
            _SteppingOn(model, params, comm=comm, sampler=sampler, profile_within_epoch="no")
        return (within.steps_while_others_profile, hooks, across.steps_while_others_profile,
                len(sampler._on_exhausted), unknown_pass.steps_while_others_profile)

    assert FakeWorld(1).run(rank_fn)[0] == (True, 1, True, 1, False)


def test_a_sampler_built_for_another_rank_or_job_size_is_refused():
    """rank=hvd.local_rank() on one-slot hosts, or num_replicas=1 in a bigger job: every
    rank would read a slice that is not its own, silently."""
    def rank_fn(comm, hvd):
        model = torch.nn.Linear(2, 1)
        params = list(model.parameters())
        errors = []
        for replicas, rank in ((2, 0), (2, 1), (1, 0)):
            sampler = ashl.HeterogeneousSampler(list(range(8)), num_replicas=replicas, rank=rank)
            try:
                _SteppingOn(model, params, comm=comm, sampler=sampler)
            except ValueError as e:
                errors.append(str(e))
        return errors

    errors = FakeWorld(2).run(rank_fn)
    assert len(errors[0]) == 2 and "built as rank 1 of 2 replicas" in errors[0][0]
    assert "rank 0 of 2" in errors[0][0] and "hvd.rank()" in errors[0][0]
    assert "built as rank 0 of 1 replicas" in errors[0][1]
    assert len(errors[1]) == 2 and "built as rank 0 of 2" in errors[1][0]


@pytest.mark.parametrize("strategy", ["localsgd", "ashl-sync", "bsp", "adsp"])
def test_profile_within_epoch_is_refused_where_no_rank_steps_on_while_profiling(strategy):
    with pytest.raises(ValueError, match=r"profile_within_epoch applies to .*\(ashl, "
                                         r"async-localsgd\), not '" + strategy):
        _strategy_options(strategy, 3, {"profile_within_epoch": False})
    assert _strategy_options("ashl", 3, {"profile_within_epoch": False})["profile_within_epoch"] \
        is False


def test_diloco_takes_the_outer_nesterov_step_on_the_average_parameters_only():
    """One round (3 commits on 3 ranks) from the same start: localsgd ends at W0 + u, diloco
    with nesterov(lr, b) at W0 + lr (1 + b) u on the parameters (the momentum's first step is
    u) and at W0 + u on the BatchNorm buffers, on every rank."""
    start = model_and_data(0)[0].state_dict()

    def run(strategy, **extra):
        def rank_fn(comm, hvd):
            model, x, y = model_and_data(comm.Get_rank())
            # the ranks' threads share torch's global RNG: both runs start from one state
            model.load_state_dict(start)
            opt = wrapped(strategy, comm, hvd, model, local_steps=4,
                          stage_config=StageConfig(max_commits=3), **extra)
            return train(opt, model, x, y)
        return FakeWorld(3).run(rank_fn)

    w0 = torch.cat([t.reshape(-1) for t in start.values() if t.is_floating_point()])
    plain = run("localsgd")
    outer = run("diloco", outer_optimizer="nesterov(0.5, 0.6)")
    params = 4 * 3 + 3 + 3 + 3        # Linear(4, 3) and BatchNorm1d(3)'s weight and bias
    u = plain[0]["flat"] - w0
    expected = torch.cat([w0[:params] + 0.5 * 1.6 * u[:params], w0[params:] + u[params:]])
    for r in outer:
        torch.testing.assert_close(r["flat"], expected, rtol=1e-5, atol=1e-6)
        assert r["counters"]["outer"] == {"spec": "nesterov(0.5, 0.6)", "updates": 1}
    assert plain[0]["counters"]["outer"] == {"spec": "none", "updates": 1}


@pytest.mark.parametrize("strategy", ["localsgd", "diloco"])
def test_a_rank_that_leaves_early_stops_the_others_on_the_same_round(strategy):
    """The leaving rank joins: the others' next round gets zeros from it and every one of
    them stops there; then its partial round (one step past its last) is added to the
    final model as it is (diloco: no further outer step), and it reports the others' stop."""
    def rank_fn(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        opt = wrapped(strategy, comm, hvd, model, local_steps=2,
                      stage_config=StageConfig(max_commits=10_000))
        leaving = comm.Get_rank() == 1
        before = {}
        original = opt.finish

        def finish():       # what each rank holds when it leaves its loop
            s = opt.strategy
            before.update(params=torch.cat([t.detach().reshape(-1).clone() for t in s.tensors]),
                          anchors=torch.cat([a.reshape(-1).clone() for a in s.anchors]))
            original()
        opt.finish = finish
        result = train(opt, model, x, y, leave_after=5 if leaving else None)
        result["final"] = torch.cat([t.detach().reshape(-1) for t in opt.strategy.tensors])
        return {**result, **before}

    results = FakeWorld(3).run(rank_fn)
    assert [r["counters"]["left_early"] for r in results] == [False, True, False]
    assert [r["counters"]["commits"] for r in results] == [3, 2, 3]   # the others' 3rd: zeros
    for r in results:
        assert r["counters"]["stop_reason"] == "1 rank(s) called finish() before the run ended"
        assert torch.equal(r["flat"], results[0]["flat"])
        assert r["transitions"] == results[0]["transitions"]
    leaver, first = results[1], results[0]
    assert torch.equal(first["params"], first["anchors"])    # stopped: nothing since its round
    partial = leaver["params"] - leaver["anchors"]
    assert partial.abs().max() > 0
    torch.testing.assert_close(first["final"], first["anchors"] + partial / 3)


def test_ranks_that_leave_at_once_are_named_in_the_stop():
    def rank_fn(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        opt = wrapped("localsgd", comm, hvd, model, local_steps=2,
                      stage_config=StageConfig(max_commits=10_000))
        return train(opt, model, x, y, leave_after=5 if comm.Get_rank() != 2 else None)

    results = FakeWorld(3).run(rank_fn)     # ranks 0 and 1 leave; 2's next round stops it
    assert [r["counters"]["left_early"] for r in results] == [True, True, False]
    for r in results:   # every rank reports the stop rank 2's round decided
        assert r["counters"]["stop_reason"] == "2 rank(s) called finish() before the run ended"
        assert torch.equal(r["flat"], results[0]["flat"])


def test_a_script_that_ends_on_every_rank_at_once_says_so():
    def rank_fn(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        opt = wrapped("localsgd", comm, hvd, model, local_steps=2,
                      stage_config=StageConfig(max_commits=10_000))
        return train(opt, model, x, y, leave_after=5)

    results = FakeWorld(3).run(rank_fn)
    assert all(r["counters"]["left_early"] for r in results)
    for r in results:
        assert r["counters"]["stop_reason"] == "every rank called finish() before the run ended"
        assert r["transitions"][-1]["reason"] == r["counters"]["stop_reason"]
        assert torch.equal(r["flat"], results[0]["flat"])


def test_the_run_keeps_its_clock_when_the_control_rank_leaves_early():
    """Rank 0 (whose clock the run read) joins: the others' stop is timed by rank 1's clock,
    not read as 0 s from rank 0's zeros."""
    def rank_fn(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        opt = wrapped("localsgd", comm, hvd, model, local_steps=2,
                      stage_config=StageConfig(max_commits=10_000))
        return train(opt, model, x, y, leave_after=5 if comm.Get_rank() == 0 else None)

    results = FakeWorld(3).run(rank_fn)
    for r in results:
        stop = r["transitions"][-1]
        assert stop["reason"] == "1 rank(s) called finish() before the run ended"
        assert stop["at_s"] > 0
        assert stop["at_s"] >= r["transitions"][-2]["at_s"]


def test_the_stop_of_ranks_that_left_names_them():
    assert left_early_reason([1], 3) == "rank(s) 1 called finish() before the run ended"
    assert left_early_reason([0, 2], 3) == "rank(s) 0, 2 called finish() before the run ended"
    assert left_early_reason([0, 1, 2], 3) == "every rank called finish() before the run ended"


def test_the_control_ranks_evaluation_stops_every_rank():
    accuracy = iter([0.1, 0.2, 0.95] + [1.0] * 100)

    def rank_fn(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        opt = wrapped("localsgd", comm, hvd, model, local_steps=1, eval_every_s=0,
                      evaluate=lambda: next(accuracy),
                      stage_config=StageConfig(target_accuracy=0.9, max_commits=10_000))
        return train(opt, model, x, y)

    results = FakeWorld(2).run(rank_fn)
    for r in results:
        assert r["counters"]["stop_reason"].startswith("target accuracy: 0.95")
    assert results[0]["counters"]["last_accuracy"] == 0.95


def test_bsp_watches_the_steps_and_stops_every_rank_together():
    def rank_fn(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        params = list(model.parameters())
        s = make_strategy("bsp", model, params, comm=comm, hvd=hvd,
                          stage_config=StageConfig(max_commits=3 * 5))
        steps = 0
        while not s.finished:
            s.before_step()
            s.after_step(float(steps))
            steps += 1
        s.finish()
        return steps, s.stop_reason, s.stage_label, s.global_commits

    results = FakeWorld(3).run(rank_fn)
    assert {r[0] for r in results} == {5}
    assert all(r[1].startswith("commit budget") and r[2] == "DONE" and r[3] == 15 for r in results)


@pytest.mark.parametrize("strategy,compressor", [
    ("localsgd", Compression.fp16), ("localsgd", Compression.topk(0.1)),
    ("ashl-sync", Compression.fp16), ("bsp", Compression.topk(0.1))])
def test_a_strategy_refuses_a_compressor_it_cannot_send(strategy, compressor):
    def rank_fn(comm, hvd):
        model, _, _ = model_and_data(0)
        with pytest.raises(ValueError, match=re.escape(f"strategy {strategy!r} cannot send with "
                                                       f"compression={compressor!r}")):
            make_strategy(strategy, model, list(model.parameters()), comm=comm, hvd=hvd,
                          compression=compressor)
        return True

    assert FakeWorld(1).run(rank_fn) == [True]


# --- the synchronous control numbers, as pure functions --------------------------------------

def test_control_slots_round_trip_and_decide_the_same_on_every_rank():
    slots = ControlSlots(3)
    parts = [slots.encode(r, loss=[0.5, None, 0.25][r], busy=0.1 * r, control=r == 0,
                          elapsed=4.0, plan_t=1.0, accuracy=0.8 if r == 0 else None,
                          present=r != 2, epoch_done=r == 1) for r in range(3)]
    reading = slots.decode(sum(parts))
    assert reading.losses == (0.5, None, 0.25) and reading.present == 2
    assert reading.epoch_done == 1
    assert reading.now == 4.0 and reading.plan_t == 1.0 and reading.accuracy == 0.8
    machines = [StageMachine(3, StageConfig()) for _ in range(3)]
    stages = {decide(m, reading) for m in machines}
    assert stages == {Stage.DONE}
    assert {m.stop_reason for m in machines} == {"1 rank(s) called finish() before the run ended"}
    assert all(m.commits == 3 for m in machines)


def test_the_clock_is_the_lowest_training_ranks():
    slots = ControlSlots(3)
    parts = [slots.encode(r, loss=None, busy=0.0, control=r == 0, elapsed=[0.0, 7.0, 7.5][r],
                          plan_t=[0.0, 1.0, 1.5][r]) for r in (1, 2)]   # rank 0: joined
    reading = slots.decode(sum(parts))
    assert reading.present == 2 and (reading.now, reading.plan_t) == (7.0, 1.0)
    machine = StageMachine(3, StageConfig())
    decide(machine, reading)
    assert machine.transitions[-1].at_s == 7.0


def test_the_clock_never_runs_back_when_its_rank_changes():
    slots = ControlSlots(2)

    def reading(*elapsed):      # (rank, its clock) of the ranks still training
        return slots.decode(sum(slots.encode(r, loss=None, busy=0.0, control=r == 0,
                                             elapsed=t, plan_t=t) for r, t in elapsed))
    machine = StageMachine(2, StageConfig())
    decide(machine, reading((0, 8.0), (1, 7.5)))     # training begins on rank 0's clock
    decide(machine, reading((1, 7.6)))               # rank 0 left; rank 1's clock lags
    assert [t.at_s for t in machine.transitions] == [8.0, 8.0]


def test_control_slots_skip_non_finite_losses():
    reading = ControlSlots(2).decode(ControlSlots(2).encode(1, loss=math.nan, busy=0.0,
                                                            control=False))
    assert reading.losses == (None, None) and reading.accuracy is None


@pytest.mark.parametrize("passes,transfer_s", [(1, 0.5), (2, 0.5), (1, 0.2)])
def test_bsp_runs_its_emulated_link_beside_the_backward_pass(monkeypatch, passes, transfer_s):
    """Horovod starts each gradient's allreduce during the step's last backward pass: a rank
    waits only for the part of the transfer that outlasts it (2/3 of 2 x 0.2 s, per pass)."""
    from ashl.emulation import Heterogeneity, Link
    waits = []
    monkeypatch.setattr(Heterogeneity, "depart", lambda self, nbytes, overlapped_s=0.0:
                        waits.append(self.link_delay(nbytes) - overlapped_s))

    def rank_fn(comm, hvd):
        model, _, _ = model_and_data(0)
        params = list(model.parameters())
        nbytes = sum(4 * p.numel() for p in params)
        hetero = Heterogeneity(2.0, Link(0.0, nbytes / transfer_s), step_s=0.2)
        s = make_strategy("bsp", model, params, comm=comm, hvd=hvd, heterogeneity=hetero,
                          stage_config=StageConfig(max_commits=3))
        s.backward_passes_per_step = passes
        while not s.finished:
            s.before_step()
            s.after_step(0.0)
        s.finish()

    FakeWorld(1).run(rank_fn)
    backward = 2 / 3 * 0.4 / passes
    assert waits == [pytest.approx(transfer_s - backward, abs=1e-3)] * 3


def test_only_shares_that_change_a_pass_already_read_count_as_late(caplog):
    # a re-plan's shares reach a rank in an epoch it has begun: harmless when they give the
    # counts it reads anyway (a re-plan that kept them), a warning when they change them
    from types import SimpleNamespace

    from ashl.planner import RankProfile, make_plan
    from ashl.strategies.parameter_server import ServerStrategy

    sampler = ashl.HeterogeneousSampler(range(90), 3, 0)
    sampler.set_epoch(4)
    list(sampler)
    equal = make_plan([RankProfile(compute_s=0.01, push_s=1e-5, pull_s=1e-5)] * 3)
    engine = SimpleNamespace(plan=equal, sampler=sampler, shares_epoch=4, stage=Stage.AHL,
                             rank=0, late_shares=0)
    ServerStrategy._give_shares(engine)
    assert engine.late_shares == 0 and "already begun" not in caplog.text
    engine.plan = make_plan([RankProfile(compute_s=c, push_s=1e-5, pull_s=1e-5)
                             for c in (0.01, 0.02, 0.04)])
    ServerStrategy._give_shares(engine)
    assert engine.late_shares == 1 and "already begun" in caplog.text
    assert sampler.counts(4) != sampler.counts(3) == (30, 30, 30)


@pytest.mark.parametrize("switch", [True, False])       # resumed in SHL, in AHL
def test_ashl_sync_resumes_from_its_checkpoint_with_its_plan_and_stage(tmp_path, switch):
    """Saved after its run ended (as ashl.train's last save), an ashl-sync run resumes on
    every rank from the saved model, in the saved stage, with the saved plan and data shares:
    no profiling round, and the counters go on from the saved ones."""
    from ashl.emulation import Heterogeneity
    path = str(tmp_path / "ckpt.pt")

    def first(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        sampler = ashl.HeterogeneousSampler(range(90), 3, comm.Get_rank())
        slow = Heterogeneity((1, 1, 3)[comm.Get_rank()], step_s=0.02)   # uneven shares
        opt = wrapped("ashl-sync", comm, hvd, model, profile_steps=3, eval_every_s=0,
                      stage_config=StageConfig(max_commits=12, switch=switch),
                      heterogeneity=slow, sampler=sampler)
        result = train(opt, model, x, y)
        opt.save_checkpoint(path)
        return dict(result, counts=sampler.counts())

    def second(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank(), seed=1)    # another initial model
        sampler = ashl.HeterogeneousSampler(range(90), 3, comm.Get_rank())
        opt = wrapped("ashl-sync", comm, hvd, model, profile_steps=3, eval_every_s=0,
                      stage_config=StageConfig(max_commits=6, switch=switch), sampler=sampler)
        opt.load_checkpoint(path)
        loaded = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()
                            if t.is_floating_point()])
        counts = sampler.counts()
        return dict(train(opt, model, x, y), loaded=loaded, counts=counts)

    saved = FakeWorld(3).run(first)
    resumed = FakeWorld(3).run(second)
    stage = [t["from"] for t in saved[0]["transitions"] if t["to"] == "DONE"][0]
    assert stage == ("SHL" if switch else "AHL")
    for before, after in zip(saved, resumed):
        assert torch.equal(after["loaded"], saved[0]["flat"])    # the saved global model
        assert after["plan"] == saved[0]["plan"]                 # not profiled again
        assert after["transitions"][0]["from"] == "PROFILE"
        assert after["transitions"][0]["reason"] == "resumed from a checkpoint"
        assert after["transitions"][0]["at_s"] == 0.0            # the same on every rank
        assert after["transitions"][-2]["to"] == stage           # and in the saved stage
        assert after["counters"]["commits"] == before["counters"]["commits"] + 2
        assert after["counters"]["local_steps"] > before["counters"]["local_steps"]
        # the data shares the saved run read with, before the loop's first pass
        assert after["counts"] == before["counts"] != (30, 30, 30)


def same(a, b) -> bool:
    """Equal, tensors by value, through dicts, lists and tuples."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) \
            and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.mark.parametrize("strategy,part", [
    ("ashl", "sampler"), ("ashl", "optimizer"), ("ashl", "residual"), ("localsgd", "sampler"),
    ("diloco", "sampler")])
def test_a_checkpoint_refused_part_way_through_its_load_changes_nothing(tmp_path, strategy,
                                                                         part):
    """A rank's part whose sampler schedule (loaded after the optimizer's state and, for
    diloco, the outer momentum), optimizer state or top-k residual does not fit: the load is
    refused, and this process's model, optimizer, outer optimizer, residual, sampler and
    counters are as before it."""
    from ashl import checkpoint
    path = str(tmp_path / "ckpt.pt")

    def rank_fn(comm, hvd):
        rank = comm.Get_rank()
        model, x, y = model_and_data(rank)
        ps = strategy == "ashl"           # a parameter server: no Horovod
        extra = {"profile_steps": 3} if ps else {"local_steps": 2}
        if part == "residual":
            extra["compression"] = Compression.topk(0.5)
        hvd = None if ps else hvd
        opt = wrapped(strategy, comm, hvd, model, eval_every_s=0,
                      sampler=ashl.HeterogeneousSampler(range(90), 2, rank),
                      stage_config=StageConfig(max_commits=4), **extra)
        train(opt, model, x, y)
        opt.save_checkpoint(path)
        own = checkpoint.load(checkpoint.rank_path(path, rank))
        if part == "sampler":
            own["sampler"]["n"] = 80
        elif part == "residual":
            own["residual"] = own["residual"][1:]
        else:
            own["optimizer"]["param_groups"][0]["params"] = [0]
        checkpoint.atomic_save(own, checkpoint.rank_path(path, rank))
        comm.Barrier()
        sampler = ashl.HeterogeneousSampler(range(90), 2, rank)
        fresh_model = model_and_data(rank)[0]
        fresh = wrapped(strategy, comm, hvd, fresh_model, eval_every_s=0, sampler=sampler,
                        **extra)
        strat = fresh.strategy

        def state():
            residual = getattr(strat, "residual", None)
            outer = getattr(strat, "outer", None)
            return copy.deepcopy((
                fresh_model.state_dict(), fresh.state_dict(), sampler.state_dict(),
                strat.counters()["local_steps"], outer and outer.state_dict(),
                residual is not None and residual.flat))

        if part == "residual":     # a rank holding error feedback (a load before this one's)
            strat.residual = Residual(strat.tensors)
            strat.residual.flat.normal_()
        before = state()
        assert part != "residual" or before[-1] is not False     # a top-k residual to keep
        with pytest.raises(ValueError, match=f"rank{rank} does not fit this run: "):
            fresh.load_checkpoint(path)
        assert same(state(), before) and not strat.resuming
        fresh.finish()
        return True

    assert FakeWorld(2).run(rank_fn) == [True, True]


@pytest.mark.parametrize("compression", [Compression.topk(0.25), Compression.none])
def test_a_resumed_rank_gets_back_the_error_feedback_it_saved(tmp_path, compression):
    """Top-k commits leave error feedback, saved with the rank's part in the middle of the run
    and read back at the load; a rank whose commits are dense takes none, saves none, and
    takes none when it resumes."""
    path = str(tmp_path / "ckpt.pt")

    def rank_fn(comm, hvd):
        rank = comm.Get_rank()
        model, x, y = model_and_data(rank)
        opt = wrapped("ashl", comm, None, model, profile_steps=3, eval_every_s=0,
                      compression=compression, stage_config=StageConfig(max_commits=40))
        saved, steps = "not saved", 0
        while not opt.finished and steps < 400:
            i = (steps * 8) % 64
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).backward()
            opt.step()
            steps += 1
            if steps == 12:      # not collective for a parameter server: each rank's own
                opt.save_checkpoint(path)
                residual = opt.strategy.residual
                saved = None if residual is None else residual.flat.clone()
        opt.finish()
        comm.Barrier()
        fresh = wrapped("ashl", comm, None, model_and_data(rank)[0], profile_steps=3,
                        eval_every_s=0, compression=compression)
        fresh.load_checkpoint(path)
        loaded = fresh.strategy.residual
        loaded = None if loaded is None else loaded.flat.clone()
        fresh.finish()
        return saved, loaded

    for saved, loaded in FakeWorld(2).run(rank_fn):
        if compression is Compression.none:
            assert saved is None and loaded is None
        else:
            assert torch.count_nonzero(saved) > 0 and torch.equal(saved, loaded)


@pytest.mark.filterwarnings("ignore:strategy 'ashl-sync' sizes")
def test_an_ashl_sync_checkpoint_whose_plan_does_not_fit_is_refused(tmp_path):
    from ashl import checkpoint
    path = str(tmp_path / "ckpt.pt")

    def rank_fn(comm, hvd):
        model, x, y = model_and_data(0)
        opt = wrapped("ashl-sync", comm, hvd, model, profile_steps=3, eval_every_s=0,
                      stage_config=StageConfig(max_commits=2))
        train(opt, model, x, y)
        opt.save_checkpoint(path)
        run = checkpoint.load(path)
        run["stage"] = "PROFILE"
        checkpoint.atomic_save(run, path)
        fresh = wrapped("ashl-sync", comm, hvd, model_and_data(0)[0], profile_steps=3)
        with pytest.raises(ValueError, match="in stage PROFILE; this job has 1 ranks"):
            fresh.load_checkpoint(path)
        del run["plan"]
        checkpoint.atomic_save(run, path)
        with pytest.raises(ValueError, match="its plan or stage cannot be read"):
            fresh.load_checkpoint(path)
        fresh.finish()
        return True

    assert FakeWorld(1).run(rank_fn) == [True]


def test_a_parameter_server_checkpoint_restores_the_samplers_schedule_at_the_load(tmp_path):
    """The resumed epoch reads with the saved run's counts, not the equal shares a sampler
    starts with until the first step adopts the plan (the batches a rank skips in that
    epoch were counted in the saved ones)."""
    from ashl.emulation import Heterogeneity
    path = str(tmp_path / "ckpt.pt")

    def run(comm, load: bool):
        model, x, y = model_and_data(comm.Get_rank())
        sampler = ashl.HeterogeneousSampler(range(90), 2, comm.Get_rank())
        slow = None if load else Heterogeneity((1, 3)[comm.Get_rank()], step_s=0.02)
        opt = ashl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), model=model, comm=comm,
            profile_steps=3, eval_every_s=0, sampler=sampler, heterogeneity=slow,
            stage_config=StageConfig(max_commits=4 if load else 8),
            # resumed without the emulated slowdown: a re-plan there would move the run's
            # shares away from the saved plan this test compares against
            drift_config=DriftConfig(enabled=not load))
        if load:
            opt.load_checkpoint(path)
        counts = sampler.counts()
        train(opt, model, x, y)
        if not load:
            opt.save_checkpoint(path)
            counts = sampler.counts()
        return counts

    saved = FakeWorld(2).run(lambda comm, hvd: run(comm, load=False))
    loaded = FakeWorld(2).run(lambda comm, hvd: run(comm, load=True))
    assert loaded == saved and saved[0] != (45, 45)


def test_parameter_server_ranks_resumed_in_other_epochs_take_the_runs_shares_together(tmp_path):
    """Each rank saved its part on its own clock: one saved before a re-plan holds older
    shares. From the first epoch no rank has begun, every rank takes the run's plan's."""
    from ashl import checkpoint
    from ashl.emulation import Heterogeneity
    path = str(tmp_path / "ckpt.pt")

    def run(comm, load: bool):
        rank = comm.Get_rank()
        model, x, y = model_and_data(rank)
        sampler = ashl.HeterogeneousSampler(range(90), 2, rank)
        slow = None if load else Heterogeneity((1, 3)[rank], step_s=0.02)
        opt = ashl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), model=model, comm=comm,
            profile_steps=3, eval_every_s=0, sampler=sampler, heterogeneity=slow,
            stage_config=StageConfig(max_commits=4 if load else 8),
            # resumed without the emulated slowdown: a re-plan there would move the run's
            # shares away from the saved plan this test compares against
            drift_config=DriftConfig(enabled=not load))
        if not load:
            train(opt, model, x, y)
            opt.save_checkpoint(path)
            return opt.plan
        if rank == 1:       # as if rank 1 had saved before the plan: equal shares
            own = checkpoint.load(checkpoint.rank_path(path, 1))
            own["sampler"]["schedule"] = [(0, [45, 45])]
            checkpoint.atomic_save(own, checkpoint.rank_path(path, 1))
        comm.Barrier()
        opt.load_checkpoint(path)
        sampler.set_epoch((3, 5)[rank])              # each resumes in its own epoch
        before = sampler.counts()
        train(opt, model, x, y)
        return before, sampler.counts(6), sampler.counts(5)

    plan = FakeWorld(2).run(lambda comm, hvd: run(comm, load=False))[0]
    stage = checkpoint.load(path)["stage"]
    (before0, at6_0, _), (before1, at6_1, at5_1) = \
        FakeWorld(2).run(lambda comm, hvd: run(comm, load=True))
    planned = ashl.HeterogeneousSampler(range(90), 2, 0,
                                        shares=list(plan.stage(stage).shares)).counts()
    assert planned != (45, 45) and before0 == planned and before1 == (45, 45)
    assert at6_0 == at6_1 == planned          # from epoch 5 + 1 on, every rank the run's
    assert at5_1 == (45, 45)                  # rank 1's resumed epoch as it began it


@pytest.mark.parametrize("compression,measured", [(None, True), (Compression.fp16, False)])
def test_ashl_profiles_the_top_k_it_may_send_on_each_ranks_own_tensors(compression, measured):
    """g_i (the planner's compress_s) is timed on the rank's own tensors at the plan's target
    ratio, and leaves the rank's error feedback as it was; a forced compressor never sends
    the plan's top-k, so nothing is timed."""
    def run(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        opt = wrapped("ashl", comm, None, model, profile_steps=3, eval_every_s=0,
                      compression=compression, stage_config=StageConfig(max_commits=6))
        strategy = opt.strategy
        original = strategy.compression_samples
        seen = {}

        def recorded(*args, **kwargs):
            samples = original(*args, **kwargs)
            seen["residual"] = (None if strategy.residual is None
                                else strategy.residual.flat.clone())
            return samples
        strategy.compression_samples = recorded
        train(opt, model, x, y)
        return opt.plan.profiles[comm.Get_rank()].compress_s, seen

    for compress_s, seen in FakeWorld(2).run(run):
        assert (compress_s > 0) == measured
        if measured:     # timed on a residual of its own: the rank's is not even taken yet
            assert seen["residual"] is None
