"""A CUDA model's path to the wire (ashl.staging), run on CPU tensors: the buffers, the
copies and what the strategies do with them (ASHL_STAGE_WIRE=1 stages a CPU model as a CUDA
one is staged). Mixed precision: a step GradScaler skips is not a local step."""
import sys
from pathlib import Path

import pytest
import torch

import ashl.torch as ashl
from ashl.compression import Compression, Payload, Residual
from ashl.protocol import Kind
from ashl.stages import StageConfig
from ashl.staging import STAGE_ENV, WireStaging

from fake_world import FakeWorld

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
from staged_bsp_amp import train_with_scaler  # noqa: E402  (the mpirun test's loop)


def test_a_cpu_model_is_not_staged_unless_asked(monkeypatch):
    monkeypatch.delenv(STAGE_ENV, raising=False)
    plain = WireStaging("cpu")
    payload = Payload.dense(torch.arange(5, dtype=torch.float32))
    assert not plain.staged and not plain.pinned
    assert plain.to_host(payload) is payload
    flat = torch.ones(3)
    assert plain.to_device(flat) is flat and plain.to_host_flat(flat) is flat
    assert plain.copies["to_host"] == plain.copies["to_device"] == 0
    monkeypatch.setenv(STAGE_ENV, "1")
    assert WireStaging("cpu").staged


def test_a_staged_payload_is_the_same_bytes_in_the_host_send_buffer():
    staging = WireStaging("cpu", staged=True)
    params = [torch.randn(7), torch.randn(3, 5)]
    anchors = [torch.zeros_like(p) for p in params]
    residual = Residual(params)
    scratch = torch.empty(22)
    out = staging.device_buffer("pack", Compression.topk(0.2).max_nbytes(22))
    packed = Compression.topk(0.2).pack(params, anchors, residual, scratch, out)
    wire = staging.to_host(packed)
    assert wire.kind == Kind.SPARSE_DELTA and wire.nnz == packed.nnz == 5
    assert wire.buffer.data_ptr() != packed.buffer.data_ptr()
    assert torch.equal(wire.buffer, packed.buffer)
    assert staging.copies == {"to_host": 1, "to_device": 0,
                              "bytes_to_host": packed.nbytes, "bytes_to_device": 0}


def test_buffers_are_kept_and_grow_never_shrink():
    staging = WireStaging("cpu", staged=True)
    first = staging.host_buffer("send", 100)
    assert staging.host_buffer("send", 60).data_ptr() == first.data_ptr()
    grown = staging.host_buffer("send", 200)
    assert grown.numel() == 200 and staging.host_buffer("send", 150) is grown
    assert staging.device_buffer("send", 10) is not grown    # device and host apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_reply_reaches_the_device_buffer_in_its_dtype(dtype):
    staging = WireStaging("cpu", staged=True)
    reply = torch.randn(9).to(dtype)
    on_device = staging.to_device(reply)
    assert on_device.dtype == dtype and on_device.data_ptr() != reply.data_ptr()
    assert torch.equal(on_device, reply)
    back = torch.empty(9, dtype=dtype)
    staging.from_host(back, staging.to_host_flat(on_device))
    assert torch.equal(back, reply) and staging.copies["to_device"] == 2


def test_compression_refuses_a_buffer_on_another_device():
    with pytest.raises(ValueError, match="out is on meta but the delta is on cpu"):
        Compression.none.compress(torch.ones(4), out=torch.empty(16, dtype=torch.uint8,
                                                               device="meta"))


# --- the strategies, staged, on the in-process fake world ------------------------------------

def model_and_data(rank: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    g = torch.Generator().manual_seed(100 + rank)
    return model, torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)


def flat_state(model) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()
                      if t.is_floating_point()])


def averaging_run(strategy: str, _device: str = "cpu", **config):
    # built here, not in the ranks' threads: torch.manual_seed is global to the process
    ranks = [[t.to(_device) for t in model_and_data(r)] for r in range(3)]

    def rank_fn(comm, hvd):
        model, x, y = ranks[comm.Get_rank()]
        opt = ashl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        model=model, strategy=strategy, comm=comm, hvd=hvd,
                                        stage_config=StageConfig(max_commits=12), **config)
        step = 0
        while not opt.finished:
            i = (step * 8) % 64
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).backward()
            opt.step()
            step += 1
        opt.finish()
        return flat_state(model), opt.counters()

    return FakeWorld(3).run(rank_fn)


@pytest.mark.parametrize("strategy,config", [
    ("localsgd", {"local_steps": 2}),
    ("diloco", {"local_steps": 2})])
def test_a_staged_allreduce_ends_with_the_unstaged_runs_model(strategy, config, monkeypatch):
    monkeypatch.delenv(STAGE_ENV, raising=False)
    plain = averaging_run(strategy, **config)
    monkeypatch.setenv(STAGE_ENV, "1")
    staged = averaging_run(strategy, **config)
    for (flat, counters), (ref, ref_counters) in zip(staged, plain):
        assert torch.equal(flat, ref)
        assert counters["staging"]["staged"] and not ref_counters["staging"]["staged"]
        # one trip each way per round, the last partial round's (finish) and the final model's
        rounds = counters["commits"]
        assert counters["staging"]["to_host"] == rounds + 2
        assert counters["staging"]["to_device"] == rounds + 2


@pytest.mark.parametrize("recipe", ["horovod", "plain"])
def test_staged_bsp_averages_before_gradscalers_inf_check(recipe, monkeypatch):
    """Horovod's GradScaler recipe (synchronize, unscale_, step under skip_synchronize) and
    a plain scaler.step(opt): the gradients are averaged as backward ends, so the scaler's
    inf check reads the same gradients on every rank. After each step every rank holds the
    same model (their data differ); rank 1's own gradient overflowing on one step makes
    every rank skip it (rank 1 skipping alone would leave rank 0 in an allreduce it never
    joins), and a skipped step is not a local step. (Parameters: BSP does not average
    BatchNorm's statistics.)"""
    monkeypatch.setenv(STAGE_ENV, "1")
    ranks = [model_and_data(r) for r in range(2)]   # (torch.manual_seed is per process)

    def rank_fn(comm, hvd):
        model, x, y = ranks[comm.Get_rank()]
        opt = ashl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model=model, strategy="bsp", comm=comm, hvd=hvd,
                                        stage_config=StageConfig(max_commits=2 * 4))
        after, scales = train_with_scaler(opt, model, x, y, recipe,
                                          overflow_on_step_1=comm.Get_rank() == 1)
        opt.finish()
        return after, scales, opt.counters()

    (a0, s0, c0), (a1, s1, c1) = FakeWorld(2).run(rank_fn)
    assert len(a0) == len(a1) == 5           # 4 counted steps and the skipped one
    for m0, m1 in zip(a0, a1):
        assert torch.equal(m0, m1)
    assert torch.equal(a0[0], a0[1])          # the skipped step left the model alone
    assert s0 == s1 and s0[1] == s0[0] / 2    # both scalers saw the inf
    assert c0["local_steps"] == c1["local_steps"] == 4
    for c in (c0, c1):
        # one trip each way per backward (the skipped step's too), and the final model's
        assert c["staging"]["staged"] and not c["horovod_optimizer"]
        assert c["staging"]["to_host"] == c["staging"]["to_device"] == 5 + 1


def test_staged_bsp_averages_once_per_step_and_zeros_a_gradient_backward_did_not_reach(
        monkeypatch):
    """backward_passes_per_step=2: one average after the second pass. A layer only rank 0's
    backward reaches has zeros on rank 1, as in Horovod, so both ranks send the same
    tensors and end with the same model."""
    monkeypatch.setenv(STAGE_ENV, "1")
    ranks = [model_and_data(r) for r in range(2)]
    heads = [torch.nn.Linear(3, 3) for _ in range(2)]
    heads[1].load_state_dict(heads[0].state_dict())

    def rank_fn(comm, hvd):
        (model, x, y), head = ranks[comm.Get_rank()], heads[comm.Get_rank()]
        both = torch.nn.ModuleList([model, head])
        opt = ashl.DistributedOptimizer(torch.optim.SGD(both.parameters(), lr=0.1),
                                        model=both, strategy="bsp", comm=comm, hvd=hvd,
                                        backward_passes_per_step=2,
                                        stage_config=StageConfig(max_commits=2 * 3))
        step = 0
        while not opt.finished:
            opt.zero_grad()
            for half in (0, 4):
                i = (step * 8 + half) % 64
                out = model(x[i:i + 4])
                if comm.Get_rank() == 0:
                    out = head(out)
                torch.nn.functional.cross_entropy(out, y[i:i + 4]).backward()
            opt.step()
            step += 1
        opt.finish()
        return flat_state(both), opt.counters()

    (m0, c0), (m1, c1) = FakeWorld(2).run(rank_fn)
    assert torch.equal(m0, m1) and c0["local_steps"] == 3
    assert c0["staging"]["to_host"] == c0["staging"]["to_device"] == 3 + 1


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("recipe", ["step", "horovod"])
def test_a_step_gradscaler_skips_is_not_a_local_step(fused, recipe):
    """GradScaler skips a plain optimizer's step(); a fused one's it calls with found_inf
    set, and the optimizer skips its own update: neither is a local step. "horovod": the
    recipe of Horovod's docs (synchronize(), unscale_ and clip, step() within
    skip_synchronize()), which a model-delta strategy runs unchanged."""
    def rank_fn(comm, hvd):
        model, x, y = model_and_data(comm.Get_rank())
        opt = ashl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, fused=fused),
                                        model=model, strategy="localsgd", local_steps=2,
                                        comm=comm, hvd=hvd,
                                        stage_config=StageConfig(max_commits=2 * 2))
        scaler = torch.amp.GradScaler("cpu")
        step = 0
        while not opt.finished:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x[:8]), y[:8])
            scaler.scale(loss).backward()
            if step == 2:
                model[0].bias.grad[0] = float("nan")
            if recipe == "horovod":
                opt.synchronize()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
            step += 1
        opt.finish()
        return step, opt.counters()["local_steps"]

    assert FakeWorld(2).run(rank_fn) == [(5, 4), (5, 4)]


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_staged_bsp_averages_a_sparse_gradient(sparse_as_dense, monkeypatch):
    """An Embedding(sparse=True): averaged dense in the one flat allreduce, then given back
    sparse for the optimizer (SparseAdam takes nothing else), or left dense with
    sparse_as_dense, as Horovod's hooks give it."""
    monkeypatch.setenv(STAGE_ENV, "1")

    def rank_fn(comm, hvd):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
        opt = ashl.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        model=model, strategy="bsp", comm=comm, hvd=hvd,
                                        sparse_as_dense=sparse_as_dense,
                                        stage_config=StageConfig(max_commits=3))
        layouts = []
        while not opt.finished:
            opt.zero_grad()
            words = torch.tensor([1, 2, 3]) + 3 * comm.Get_rank()   # each rank its own rows
            model(words).square().sum().backward()
            opt.step()
            grad = model[0].weight.grad
            layouts.append(grad.is_sparse and grad.sparse_dim())   # by row, as torch's
        opt.finish()
        return flat_state(model), layouts

    (m0, l0), (m1, l1) = FakeWorld(2).run(rank_fn)
    assert torch.equal(m0, m1)
    assert l0 == l1 and set(l0) == {False if sparse_as_dense else 1}


# --- on a GPU (skipped without one) ------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@cuda
def test_a_cuda_payload_reaches_pinned_host_memory_in_one_copy():
    staging = WireStaging("cuda:0")
    assert staging.staged and staging.pinned
    params = [torch.randn(1001, device="cuda"), torch.randn(7, 3, device="cuda")]
    anchors = [torch.zeros_like(p) for p in params]
    residual = Residual(params)
    scratch = torch.empty(1022, device="cuda")
    compressor = Compression.topk(0.05)
    out = staging.device_buffer("pack", compressor.max_nbytes(1022))
    packed = compressor.pack(params, anchors, residual, scratch, out)
    wire = staging.to_host(packed)
    assert wire.buffer.device.type == "cpu" and wire.buffer.is_pinned()
    assert torch.equal(wire.buffer, packed.buffer.cpu())
    assert staging.copies["to_host"] == 1
    reply = torch.randn(1022).pin_memory()
    on_device = staging.to_device(reply)
    assert on_device.is_cuda and torch.equal(on_device.cpu(), reply)


@cuda
def test_a_cuda_model_averages_through_host_memory_like_a_cpu_model(monkeypatch):
    """FakeHorovod has no GPU operations: the CUDA model's rounds are staged."""
    monkeypatch.delenv(STAGE_ENV, raising=False)
    plain = averaging_run("localsgd", local_steps=2)
    on_gpu = averaging_run("localsgd", local_steps=2, _device="cuda")
    for (flat, counters), (ref, _) in zip(on_gpu, plain):
        assert flat.is_cuda and torch.allclose(flat.cpu(), ref, atol=1e-5)
        assert counters["device"] == "cuda:0" and counters["staging"]["staged"]


def test_global_model_on_is_host_or_device_and_for_a_parameter_server_alone():
    from ashl.strategies.parameter_server import check_global_model_on
    from ashl.torch.optimizer import _strategy_options
    assert check_global_model_on("device") == "device"
    with pytest.raises(ValueError, match="global_model_on must be 'host'.*got 'gpu'"):
        check_global_model_on("gpu")
    with pytest.raises(ValueError, match="global_model_on='device': strategy 'localsgd' has no "
                                         "parameter server"):
        _strategy_options("localsgd", 3, {"global_model_on": "device"})
