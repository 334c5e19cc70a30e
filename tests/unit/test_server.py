"""The parameter server's rules without MPI: merge weights, staleness, the SHL bound,
non-finite and malformed deltas, stop."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ashl.compression import Compression
from ashl.coordinator import Coordinator
from ashl.outer import PlainMerge
from ashl.planner import RankProfile
from ashl.protocol import DType, Flag, Header, Kind, ProtocolError
from ashl.server import (LATENCY_SAMPLES, ParameterServer, ServerStats, busy_fraction,
                         latency_summary, nearest_rank)
from ashl.staleness import parse_staleness
from ashl.stages import Stage, StageConfig
from ashl.staging import WireStaging
from ashl.transport import ServerEnd

N = 10


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.001
        return self.t


def server(n_ranks=3, stage=Stage.AHL, staleness="none", bound=3, downlink=torch.float32,
           staging=None, **stage_kw):
    clock = Clock()
    coord = Coordinator(n_ranks, stage_config=StageConfig(switch_loss=-1.0, **stage_kw),
                        clock=clock)
    coord.plan_from_profiles([RankProfile(compute_s=0.01 * (r + 1), push_s=0.01, pull_s=0.01)
                              for r in range(n_ranks)])
    if stage == Stage.SHL:
        coord.machine.resume(Stage.SHL, clock())
        coord._sync_stage()
    return ParameterServer(torch.zeros(N), n_ranks, coord, staleness=staleness, bound=bound,
                           clock=clock, downlink=downlink, staging=staging)


def dense(rank, values, stage=Stage.AHL, base=0, commit=0, flags=Flag(0)):
    payload = torch.as_tensor(values, dtype=torch.float32).contiguous()
    h = Header(kind=Kind.DENSE_DELTA, rank=rank, stage=stage, commit=commit,
               base_version=base, plan_version=1, dtype=DType.FLOAT32, numel=N, flags=flags,
               step_s=0.01, loss=1.0)
    return h, payload.view(torch.uint8)


def sparse(rank, idx, vals, stage=Stage.AHL, base=0):
    idx = torch.as_tensor(idx, dtype=torch.int32)
    vals = torch.as_tensor(vals, dtype=torch.float32)
    raw = torch.cat([idx.view(torch.uint8), vals.view(torch.uint8)])
    h = Header(kind=Kind.SPARSE_DELTA, rank=rank, stage=stage, base_version=base,
               plan_version=1, dtype=DType.FLOAT32, numel=N, nnz=len(idx), step_s=0.01, loss=1.0)
    return h, raw


def test_merge_uses_the_plans_weight_and_staleness():
    s = server(staleness="polynomial(1)")
    w = [float(x) for x in s.coordinator.plan.ahl.merge_weights]
    s.handle(*dense(0, torch.ones(N)))
    assert torch.allclose(s.model, torch.full((N,), w[0]))
    # rank 1's delta was computed against version 0; one version passed: within one commit of
    # each other rank (3 ranks: 2 versions), so not damped
    replies = s.handle(*dense(1, torch.ones(N), base=0))
    assert torch.allclose(s.model, torch.full((N,), w[0] + w[1]))
    assert s.version == 2 and s.stats.max_staleness == 1
    (r,) = replies
    assert r.dest == 1 and r.header.kind == Kind.REPLY and r.header.flags & Flag.ACCEPTED
    assert r.header.base_version == 2 and torch.equal(r.payload, s.model)
    # rank 2's is 4 versions old, 2 beyond a round of the others: factor 1/(1 + 2)
    s.version = 4
    s.handle(*dense(2, torch.ones(N), base=0))
    assert torch.allclose(s.model, torch.full((N,), w[0] + w[1] + w[2] / 3))


def test_a_large_model_merged_into_a_second_buffer_replies_and_rejects_as_in_place(
        monkeypatch):
    """outer.PlainMerge from its size on: the model's storage alternates, its values, the
    replies and the guard do not change."""
    g = torch.Generator().manual_seed(4)
    deltas = [torch.randn(N, generator=g) for _ in range(4)]
    deltas[2][3] = math.inf
    runs = []
    for threshold in (1 << 30, 1):
        monkeypatch.setattr(PlainMerge, "double_buffer_numel", threshold)
        s = server()
        storages, seen = set(), []
        for rank, d in enumerate(deltas):
            (r,) = s.handle(*dense(rank % 3, d, base=s.version))
            storages.add(s.model.data_ptr())
            assert torch.equal(r.payload, s.model)
            seen.append((s.model.clone(), bool(r.header.flags & Flag.ACCEPTED)))
        runs.append(seen)
        assert len(storages) == (1 if threshold > N else 2)
        assert s.stats.rejected_nonfinite == 1 and s.version == 3
    for (m0, a0), (m1, a1) in zip(*runs):
        assert torch.equal(m0, m1) and a0 == a1


@given(st.integers(0, 100), st.integers(1, 16))
def test_damping_counts_the_versions_beyond_one_round_of_the_other_ranks(staleness, live):
    s = server(n_ranks=16)
    s.live = set(range(live))
    assert s.excess(staleness) == max(0, staleness - (live - 1))


def test_nonfinite_delta_is_rejected_counted_and_answered():
    s = server()
    s.handle(*dense(0, torch.ones(N)))
    before = s.model.clone()
    bad = torch.ones(N)
    bad[7] = math.nan
    (r,) = s.handle(*dense(1, bad))
    assert torch.equal(s.model, before)
    assert s.stats.rejected_nonfinite == 1 and s.version == 1
    assert not r.header.flags & Flag.ACCEPTED
    assert torch.equal(r.payload, before)   # the rank resumes from the global model


def test_sparse_index_out_of_range_writes_nothing():
    s = server()
    with pytest.raises(IndexError, match="out of range"):
        s.handle(*sparse(0, [1, N], [1.0, 1.0]))
    assert torch.equal(s.model, torch.zeros(N))


def test_topk_at_ratio_one_gives_the_same_model_as_dense():
    torch.manual_seed(0)
    deltas = [torch.randn(N) for _ in range(6)]
    a, b = server(), server()
    for i, d in enumerate(deltas):
        a.handle(*dense(i % 3, d, base=i))
        payload = Compression.topk(1.0, dense_when_cheaper=False).compress(d.clone())
        h = Header(kind=payload.kind, rank=i % 3, stage=Stage.AHL, base_version=i,
                   plan_version=1, dtype=payload.dtype, numel=N, nnz=payload.nnz if payload.sparse else 0,
                   step_s=0.01, loss=1.0)
        b.handle(h, payload.buffer)
    c = server()   # and an explicit all-index sparse payload lands on the same model too
    for i, d in enumerate(deltas):
        c.handle(*sparse(i % 3, list(range(N)), d, base=i))
    assert torch.equal(a.model, b.model)
    assert torch.equal(a.model, c.model)


def test_shl_reply_waits_for_the_slowest_rank_within_the_bound():
    s = server(n_ranks=2, stage=Stage.SHL, bound=2)
    out = []
    for c in range(3):   # rank 0 runs ahead: commits 1, 2 answered, 3 is held back
        out.append(s.handle(*dense(0, torch.zeros(N), stage=Stage.SHL, commit=c)))
    assert [len(r) for r in out] == [1, 1, 0]
    assert 0 in s.waiting and s.stats.waits == 1
    released = s.handle(*dense(1, torch.zeros(N), stage=Stage.SHL))
    assert sorted(r.dest for r in released) == [0, 1]
    assert s.stats.max_shl_lead <= 2
    assert all(rank_commits - slowest <= 2 for _, rank_commits, slowest in s.stats.shl_log)


def test_stop_releases_waiting_ranks_with_stop():
    s = server(n_ranks=2, stage=Stage.SHL, bound=0)
    assert s.handle(*dense(0, torch.zeros(N), stage=Stage.SHL)) == []
    (r,) = s.stop("test is over")
    assert r.dest == 0 and r.header.flags & Flag.STOP
    assert 0 not in s.live


def test_final_commit_leaves_and_unblocks_the_others():
    s = server(n_ranks=2, stage=Stage.SHL, bound=0)
    assert s.handle(*dense(0, torch.zeros(N), stage=Stage.SHL)) == []
    replies = s.handle(*dense(1, torch.zeros(N), stage=Stage.SHL, flags=Flag.FINAL))
    assert {r.dest for r in replies} == {0, 1}
    assert next(r for r in replies if r.dest == 1).header.flags & Flag.STOP
    assert s.live == {0}


def test_commit_budget_stops_the_run():
    s = server(max_commits=2)
    s.handle(*dense(0, torch.ones(N)))
    (r,) = s.handle(*dense(1, torch.ones(N)))
    assert r.header.flags & Flag.STOP and s.stopped
    version = s.version
    s.handle(*dense(2, torch.ones(N)))   # after DONE: answered, not merged
    assert s.version == version


def test_server_rejects_messages_it_does_not_take():
    s = server()
    h = Header(kind=Kind.PLAN, rank=1, dtype=DType.UINT8, numel=2)
    with pytest.raises(ProtocolError, match="kind"):
        s.handle(h, torch.zeros(2, dtype=torch.uint8))


def test_fp16_downlink_halves_the_reply():
    s = ParameterServer(torch.zeros(N), 2, server(n_ranks=2).coordinator,
                        downlink=torch.float16)
    (r,) = s.handle(*dense(0, torch.full((N,), 0.5)))
    assert r.payload.dtype == torch.float16 and r.header.dtype == DType.FLOAT16


@pytest.mark.parametrize("spec,s,value", [("none", 5, 1.0), ("polynomial(0.5)", 3, 0.5),
                                          ("hinge(1, 2)", 2, 1.0), ("hinge(1, 2)", 4, 1 / 3)])
def test_staleness_functions(spec, s, value):
    assert parse_staleness(spec)(s) == pytest.approx(value)


@pytest.mark.parametrize("spec", ["linear(1)", "polynomial", "hinge(1)", "polynomial(-1)",
                                  "polynomial(x)", "none(1)"])
def test_bad_staleness_functions_are_named(spec):
    with pytest.raises(ValueError, match="staleness function"):
        parse_staleness(spec)


def test_bad_server_arguments():
    coord = server().coordinator
    with pytest.raises(ValueError, match="flat fp32"):
        ParameterServer(torch.zeros(2, 2), 3, coord)
    with pytest.raises(ValueError, match="bound"):
        ParameterServer(torch.zeros(N), 3, coord, bound=-1)
    with pytest.raises(ValueError, match="downlink"):
        ParameterServer(torch.zeros(N), 3, coord, downlink=torch.int8)


def test_time_budget_releases_held_ranks_on_tick():
    s = server(n_ranks=2, stage=Stage.SHL, bound=0, max_seconds=5.0)
    assert s.handle(*dense(0, torch.zeros(N), stage=Stage.SHL)) == []
    assert s.tick() == []            # within budget: still held
    s.clock.t += 10.0                # no commit arrives, but time runs out
    (r,) = s.tick()
    assert r.dest == 0 and r.header.flags & Flag.STOP and s.stopped


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6), st.booleans(),
                          st.integers(0, 2 ** 16)), min_size=1, max_size=10),
       st.sampled_from(["nesterov(0.7, 0.9)", "delayed-nesterov(0.5, 0.8)"]))
@settings(max_examples=40, deadline=None)
def test_the_outer_optimizer_takes_the_weighted_damped_delta(commits, spec):
    """The server hands its outer optimizer merge weight x staleness damping x delta (dense
    or sparse): the global model is torch's Nesterov SGD (per update, or per round of 3
    updates for Delayed Nesterov) on minus those updates."""
    from ashl.outer import make_outer
    s = server(staleness="polynomial(0.5)")
    s.outer = make_outer(spec, N, round_updates=3)
    damp = parse_staleness("polynomial(0.5)")
    ref = torch.nn.Parameter(torch.zeros(N, dtype=torch.float64))
    lr, b = s.outer.spec.lr, s.outer.spec.momentum
    sgd = torch.optim.SGD([ref], lr=lr, momentum=b, nesterov=True)
    every = 3 if spec.startswith("delayed") else 1
    block = torch.zeros(N, dtype=torch.float64)
    for i, (rank, age, as_sparse, seed) in enumerate(commits, start=1):
        delta = torch.randn(N, generator=torch.Generator().manual_seed(seed))
        base = max(0, s.version - age)
        # the plan's weight now (a drift re-plan may change it) x the damping (a base before
        # the rank's last reply is an overlapped commit's: that flight is expected)
        in_flight = max(0, s.replied_version[rank] - base)
        weight = s.weight(rank, Stage.AHL) * damp(s.excess(s.version - base, in_flight))
        if as_sparse:
            idx = sorted(torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:4].tolist())
            s.handle(*sparse(rank, idx, delta[idx], base=base))
            full = torch.zeros(N)
            full[idx] = delta[idx]
            delta = full
        else:
            s.handle(*dense(rank, delta, base=base))
        block += weight * delta.double()
        if i % every == 0:
            ref.grad = -block
            sgd.step()
            block.zero_()
            torch.testing.assert_close(s.model.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    assert s.outer.updates == len(commits) == s.stats.merged


def test_a_non_finite_delta_leaves_the_outer_momentum_alone():
    from ashl.outer import make_outer
    s = server()
    s.outer = make_outer("nesterov(0.7, 0.9)", N, round_updates=3)
    s.handle(*dense(0, torch.ones(N)))
    model, momentum = s.model.clone(), s.outer.momentum.clone()
    bad = torch.ones(N)
    bad[3] = math.inf
    s.handle(*dense(1, bad))
    assert torch.equal(s.model, model) and torch.equal(s.outer.momentum, momentum)
    assert s.stats.rejected_nonfinite == 1 and s.outer.updates == 1


# ------------------------------------------------- the server thread's own statistics

seconds = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)


@given(cpu=seconds, wall=seconds)
def test_busy_fraction_is_a_share_of_the_wall_time(cpu, wall):
    share = busy_fraction(cpu, wall)
    if wall == 0:
        assert share is None
    else:
        assert 0.0 <= share <= 1.0
        assert share == 1.0 or math.isclose(share * wall, cpu, rel_tol=1e-9, abs_tol=1e-12)


@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), min_size=1),
       st.floats(min_value=1e-6, max_value=1.0))
def test_nearest_rank_is_a_measured_value_with_q_of_them_at_or_below(values, q):
    ordered = sorted(values)
    x = nearest_rank(ordered, q)
    assert x in ordered
    assert sum(v <= x for v in ordered) >= q * len(ordered)   # at least q of them up to it
    assert sum(v < x for v in ordered) < q * len(ordered)     # and fewer strictly below


def test_nearest_rank_by_hand():
    assert nearest_rank([1, 2, 3, 4], 0.5) == 2
    assert nearest_rank(list(range(1, 101)), 0.95) == 95
    assert nearest_rank([7], 0.95) == 7


@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False)),
       st.integers(min_value=0, max_value=10 ** 6))
def test_latency_summary(samples, extra):
    s = latency_summary(samples, len(samples) + extra)
    assert s["count"] == len(samples) + extra and s["samples"] == len(samples)
    if samples:
        assert min(samples) <= s["median_ms"] <= s["p95_ms"] <= max(samples)
    else:
        assert s["median_ms"] is None and s["p95_ms"] is None


def test_stats_keep_the_latest_latencies_and_report_the_summary_and_busy_fraction():
    stats = ServerStats(thread_cpu_s=0.5, thread_wall_s=2.0)
    for i in range(LATENCY_SAMPLES + 10):
        stats.latency_ms.append(float(i))
        stats.replies_timed += 1
    d = stats.to_dict()
    assert d["busy_fraction"] == 0.25
    assert d["commit_latency"]["count"] == LATENCY_SAMPLES + 10
    assert d["commit_latency"]["samples"] == LATENCY_SAMPLES    # the memory stays flat
    assert d["commit_latency"]["median_ms"] == 10 + LATENCY_SAMPLES // 2 - 1
    assert "latency_ms" not in d and "replies_timed" not in d


@pytest.mark.parametrize("downlink", [torch.float32, torch.float16])
def test_a_global_model_on_a_device_merges_and_replies_as_one_in_host_memory(downlink):
    """global_model_on="device", run on CPU tensors (staging.py): each commit's bytes copied
    to the model's buffer first, a reply's model copied to host memory once per version."""
    plain = server(downlink=downlink)
    staged = server(downlink=downlink, staging=WireStaging("cpu", staged=True))
    commits = [dense(0, torch.ones(N)), sparse(1, [1, 7], [0.5, -2.0]),
               dense(2, [float("nan")] + [1.0] * (N - 1)), dense(0, torch.arange(N), commit=1)]
    for commit in commits:
        expected, got = plain.handle(*commit), staged.handle(*commit)
        assert [r.header for r in got] == [r.header for r in expected]
        for a, b in zip(expected, got):
            assert torch.equal(a.payload, b.payload)
            assert b.payload.data_ptr() != staged.model.data_ptr()   # a host copy
    assert torch.equal(plain.model, staged.model) and staged.version == 3
    assert staged.stats.rejected_nonfinite == 1
    assert staged.staging.copies["to_device"] == len(commits)
    assert staged.staging.copies["to_host"] == 3       # versions 1, 2 and 3 (the NaN: none)


def test_the_server_thread_sets_its_own_kernel_threads(monkeypatch):
    """OpenMP's thread count is per thread: the server thread sets its own, once, before its
    first merge, and leaves the training thread's alone (None: OpenMP's default)."""
    import threading

    import ashl.server as server_module
    from ashl.server import ServerThread
    calls = []
    monkeypatch.setattr(server_module.kernels, "set_num_threads",
                        lambda n: calls.append((threading.current_thread().name, n)))

    class IdleEnd(ServerEnd):
        def poll(self, timeout):
            return None

        def close(self):
            pass

    for threads, expected in ((1, [("ashl-server", 1)]), (None, [])):
        calls.clear()
        s = server()
        s.live = set()            # the thread's loop ends at once
        thread = ServerThread(s, IdleEnd(), tick_s=0.01, threads=threads).start()
        thread.join(10)
        assert calls == expected


def test_server_threads_is_a_positive_integer_and_for_a_parameter_server_alone():
    from ashl.strategies.parameter_server import check_server_threads
    from ashl.torch.optimizer import _strategy_options
    assert check_server_threads(None) is None and check_server_threads(2) == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="server_threads must be None .* or an integer >= 1"):
            check_server_threads(bad)
    with pytest.raises(ValueError, match="server_threads=1: strategy 'bsp' has no parameter "
                                         "server"):
        _strategy_options("bsp", 3, {"server_threads": 1})
