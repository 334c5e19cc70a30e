"""Evaluations (the strategies' cadence and the one evaluation in flight) and
BackgroundEvaluator (a snapshot evaluated in a thread)."""
import threading
import time
from concurrent.futures import Future

import pytest
import torch

import ashl.torch as ashl
from ashl.stages import StageConfig
from ashl.strategies.base import Evaluations
from fake_world import FakeWorld


def test_an_accuracy_returned_at_once_is_taken_at_once_and_keeps_the_cadence():
    e = Evaluations(lambda: 0.5, every_s=60)
    assert e.start(save=lambda: "model") and e.take(wait=False) == 0.5
    assert e.saved is None and e.last_accuracy == 0.5      # the model is still the one held
    assert not e.start() and e.take(wait=False) is None      # not due for 60 s
    assert e.maybe() is None


def test_a_future_is_taken_once_done_and_no_second_starts_while_it_runs():
    pending, calls = Future(), []
    e = Evaluations(lambda: calls.append(1) or pending, every_s=0)
    assert e.start(save=lambda: "snapshot")
    assert e.take(wait=False) is None and e.saved is None
    assert not e.start() and len(calls) == 1                  # one in flight at most
    pending.set_result(0.75)
    assert e.take(wait=False) == 0.75 and e.saved == "snapshot"
    assert e.take(wait=False) is None                         # taken once
    assert e.start()                                          # the next one may start


def test_waiting_for_a_background_evaluation_counts_as_time_held():
    pending = Future()
    threading.Timer(0.05, pending.set_result, (0.9,)).start()
    e = Evaluations(lambda: pending, every_s=0)
    assert e.maybe() == 0.9
    assert e.spent_s >= 0.04


def test_an_evaluation_that_failed_raises_where_it_is_taken():
    pending = Future()
    e = Evaluations(lambda: pending, every_s=0)
    e.start()
    pending.set_exception(RuntimeError("the test set is gone"))
    with pytest.raises(RuntimeError, match="the test set is gone"):
        e.take(wait=False)
    assert e.pending is None


def _sum_of_weights(model):
    return float(sum(p.sum() for p in model.parameters()))


def test_the_background_evaluator_evaluates_the_model_as_it_was_when_called():
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    threads = []

    def accuracy_of(snapshot):
        threads.append(threading.current_thread())
        assert snapshot is not model and not snapshot.training
        return _sum_of_weights(snapshot)

    evaluator = ashl.BackgroundEvaluator(model, accuracy_of)
    pending = evaluator()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(5.0)                                   # training goes on
    assert pending.result(timeout=10) == 8.0               # 6 weights + 2 biases, all 1
    assert threads == [threads[0]] and threads[0] is not threading.current_thread()
    assert model.training                                  # the live model's mode is kept
    assert evaluator().result(timeout=10) == 40.0
    evaluator.close()
    assert evaluator.evaluations == 2 and evaluator.spent_s > 0


def test_a_call_while_one_is_in_flight_waits_instead_of_overwriting_its_snapshot():
    model = torch.nn.Linear(1, 1, bias=False)
    release, entered = threading.Event(), threading.Event()

    def accuracy_of(snapshot):
        entered.set()
        release.wait(10)
        return float(snapshot.weight)

    evaluator = ashl.BackgroundEvaluator(model, accuracy_of)
    with torch.no_grad():
        model.weight.fill_(1.0)
    first = evaluator()
    entered.wait(10)
    assert evaluator.busy
    with torch.no_grad():
        model.weight.fill_(2.0)
    threading.Timer(0.05, release.set).start()
    t0 = time.perf_counter()
    second = evaluator()                       # waits for the first before copying
    assert time.perf_counter() - t0 >= 0.04
    assert first.result(timeout=10) == 1.0 and second.result(timeout=10) == 2.0
    evaluator.close()


@pytest.mark.parametrize("strategy, extra", [
    ("localsgd", {"local_steps": 2}),     # evaluated after a round, taken at the next exchange
    ("ashl", {"profile_steps": 3}),       # the global model evaluated between steps, taken later
])
def test_a_run_stopped_by_a_background_evaluation_keeps_the_model_it_evaluated(strategy, extra):
    def rank_fn(comm, hvd):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        g = torch.Generator().manual_seed(comm.Get_rank())
        x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
        evaluated = []

        def accuracy_of(snapshot):
            flat = torch.cat([p.reshape(-1) for p in snapshot.parameters()]).clone()
            evaluated.append(flat)
            return 0.95 if len(evaluated) >= 3 else 0.1

        # made before the optimizer, which then moves the parameters into one flat buffer
        evaluate = ashl.BackgroundEvaluator(model, accuracy_of) if comm.Get_rank() == 0 else None
        opt = ashl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), model=model, strategy=strategy,
            comm=comm, eval_every_s=0, evaluate=evaluate,
            **({} if strategy == "ashl" else {"hvd": hvd}),
            stage_config=StageConfig(target_accuracy=0.9, max_commits=10_000), **extra)
        step = 0
        while not opt.finished and step < 2000:
            opt.zero_grad()
            i = (step * 8) % 64
            torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).backward()
            opt.step()
            step += 1
        opt.finish()
        if evaluate is not None:
            evaluate.close()
        return {"flat": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "evaluated": evaluated, "reason": opt.counters()["stop_reason"]}

    results = FakeWorld(2).run(rank_fn)
    assert all(r["reason"].startswith("target accuracy: 0.95") for r in results)
    assert torch.equal(results[0]["flat"], results[1]["flat"])
    assert len(results[0]["evaluated"]) == 3          # none started once the run stopped
    assert torch.equal(results[0]["flat"], results[0]["evaluated"][2])


def _adsp_rank_committing_once(evaluating: bool, flat_storage: bool = True,
                               fail_at: int = 0) -> dict:
    """One adsp rank that commits after its first step and then not for 1000 s; a model
    with BatchNorm buffers, stored flat or not; the callback raises on its `fail_at`-th call."""
    def rank_fn(comm, hvd):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6),
                                    torch.nn.Linear(6, 3))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
        seen, raised = [], []

        def evaluate():
            seen.append(_state(model))
            if len(seen) == fail_at:
                raise RuntimeError("the user's evaluation failed")
            return 0.1

        opt = ashl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model,
            strategy="adsp", comm=comm, evaluate=evaluate if evaluating else None,
            eval_every_s=0, min_commit_interval_s=1000, search=False,
            flat_storage=flat_storage, stage_config=StageConfig(max_commits=10_000))
        after = []
        for step in range(12):
            opt.zero_grad()
            i = (step * 8) % 64
            torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).backward()
            try:
                opt.step()
            except RuntimeError as e:
                raised.append(str(e))
            after.append(_state(model))
        commits = opt.counters()["commits"]
        opt.finish()
        return {"seen": seen, "after": after, "commits": commits, "raised": raised}

    return FakeWorld(1).run(rank_fn)[0]


def _state(model):
    """Parameters and floating-point buffers (BatchNorm's running statistics), flat."""
    return torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()
                      if t.is_floating_point()]).clone()


@pytest.mark.parametrize("flat_storage", [True, False])
def test_the_server_rank_evaluates_the_global_model_once_per_version_and_keeps_its_own(
        flat_storage):
    """One is due after every step (eval_every_s=0), but a model already evaluated is not
    evaluated again: the rank that commits once evaluates W once, W and not the model it
    trains. Its own model comes back after the call, so its steps end where those of a run
    without evaluations end."""
    r = _adsp_rank_committing_once(True, flat_storage)
    plain = _adsp_rank_committing_once(False, flat_storage)
    global_model = r["after"][0]          # the first step's commit was answered with W
    assert r["commits"] == plain["commits"] == 1
    assert len(r["seen"]) == 1
    assert torch.equal(r["seen"][0], global_model)
    assert not torch.equal(r["after"][-1], global_model)
    assert all(torch.equal(a, b) for a, b in zip(r["after"], plain["after"]))


def test_the_server_rank_evaluates_a_global_model_changed_by_another_rank_between_its_steps():
    """On a clock, not at its replies: after the other rank's second commit has changed W,
    the server rank, which has not committed since its first step, evaluates W at its next
    step. No model is evaluated twice in a row."""
    at_six, other_committed, server_done = threading.Event(), threading.Event(), threading.Event()

    def rank_fn(comm, hvd):
        rank = comm.Get_rank()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        g = torch.Generator().manual_seed(1 + rank)
        x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
        seen = []

        def evaluate():
            seen.append(_state(model))
            return 0.1

        # the other rank commits at every step it takes, the server rank only at its first
        interval = 1000 if rank == 0 else 1e-3
        opt = ashl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model=model, strategy="adsp",
            comm=comm, evaluate=evaluate if rank == 0 else None, eval_every_s=0,
            check_period_s=interval, min_commit_interval_s=interval, search=False,
            stage_config=StageConfig(max_commits=10_000))
        after = []
        for step in range(12 if rank == 0 else 2):
            if rank == 0 and step == 6:
                at_six.set()
                assert other_committed.wait(30)
            if rank == 1 and step == 1:
                assert at_six.wait(30)
            opt.zero_grad()
            i = (step * 8) % 64
            torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).backward()
            opt.step()
            after.append(_state(model))
        if rank == 1:
            other_committed.set()          # its second commit was answered: W has it
            assert server_done.wait(30)
        else:
            server_done.set()
        commits = opt.counters()["commits"]
        opt.finish()
        return {"seen": seen, "after": after, "commits": commits}

    server, other = FakeWorld(2).run(rank_fn)
    assert server["commits"] == 1 and other["commits"] == 2
    assert torch.equal(server["seen"][-1], other["after"][1])   # W with the other's commit
    assert not any(torch.equal(server["seen"][-1], a) for a in server["after"])
    assert all(not torch.equal(a, b) for a, b in zip(server["seen"], server["seen"][1:]))
    assert 2 <= len(server["seen"]) <= 3      # one evaluation per version of W at most


def test_an_evaluation_that_raises_leaves_the_rank_its_own_model():
    r, plain = _adsp_rank_committing_once(True, fail_at=1), _adsp_rank_committing_once(False)
    assert r["raised"] == ["the user's evaluation failed"]
    assert all(torch.equal(a, b) for a, b in zip(r["after"], plain["after"]))


def test_the_copy_takes_every_buffer_and_holds_no_more_than_the_model():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.register_buffer("ema", torch.zeros(8), persistent=False)

    model = Net()
    from ashl.strategies.model_state import store_flat
    # every tensor a view of one buffer, as DistributedOptimizer stores a CPU model
    assert store_flat(model, list(model.parameters())) is None
    evaluator = ashl.BackgroundEvaluator(model, lambda m: float(m.ema.sum()))
    sizes = {t.untyped_storage().nbytes() for t in evaluator.snapshot.buffers()}
    assert sizes == {8 * 4}      # not the whole flat model's storage
    with torch.no_grad():
        model.ema.fill_(1.0)
    assert evaluator().result(timeout=10) == 8.0
    evaluator.close()


def test_a_closed_evaluator_starts_nothing():
    evaluator = ashl.BackgroundEvaluator(torch.nn.Linear(1, 1), lambda m: 1.0)
    evaluator.close()
    assert evaluator() is None
    e = Evaluations(evaluator, every_s=0)
    assert not e.start() and e.pending is None and e.take(wait=True) is None


def test_leaving_the_run_starts_no_evaluation_even_with_the_evaluator_gone():
    """At interpreter exit the evaluation thread's pool is shut down before ashl leaves the
    run for a script that never called finish(); closing the evaluator first is the same.
    The last exchange lands a reply on the server rank, where an evaluation is due."""
    def rank_fn(comm, hvd):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
        evaluate = (ashl.BackgroundEvaluator(model, lambda m: 0.1)
                    if comm.Get_rank() == 0 else None)
        opt = ashl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), model=model, strategy="ashl",
            comm=comm, eval_every_s=0, evaluate=evaluate, profile_steps=3,
            stage_config=StageConfig(target_accuracy=0.9, max_commits=10_000))
        for step in range(400):                    # the script's own loop, left while a
            opt.zero_grad()                        # commit is in flight (its reply lands
            torch.nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
            opt.step()                             # in finish(), where one was evaluated)
            if step >= 20 and opt.strategy.client.inflight is not None:
                break
        started = evaluate.evaluations if evaluate is not None else 0
        if evaluate is not None:
            evaluate.close()
        opt.finish()
        return {"started_after_close": (evaluate.evaluations - started) if evaluate else 0,
                "reason": opt.counters()["stop_reason"]}

    results = FakeWorld(2).run(rank_fn)
    assert [r["started_after_close"] for r in results] == [0, 0]
    assert all("finish()" in (r["reason"] or "finish()") for r in results)
