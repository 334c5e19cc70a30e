"""The GPU data path's decisions, run on CPU tensors: the server stream's order against the
training thread's, Horovod's GPU support, optimizer state through host memory, the staging
buffers' growth, the rank's current CUDA device."""
import contextlib
import types

import pytest
import torch

import ashl.torch.functions as functions
from ashl.coordinator import Coordinator
from ashl.outer import make_outer
from ashl.planner import RankProfile
from ashl.server import ParameterServer, ServerThread
from ashl.stages import StageConfig
from ashl.staging import GROWTH, WireStaging
from ashl.strategies.runtime import horovod_gpu_operations, horovod_reduces_on
from ashl.transport import ServerEnd

CUDA = torch.device("cuda:0")


# ------------------------------------------------------------------ the server's stream

class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


def parameter_server(numel=6, outer="none"):
    coordinator = Coordinator(1, stage_config=StageConfig(switch_loss=-1.0, max_commits=1))
    coordinator.plan_from_profiles([RankProfile(compute_s=0.01, push_s=0.001, pull_s=0.001)])
    return ParameterServer(torch.arange(numel, dtype=torch.float32), 1, coordinator,
                           outer=make_outer(outer, numel, round_updates=1))


class IdleEnd(ServerEnd):
    def poll(self, timeout):
        return None

    def close(self):
        pass


def test_a_cpu_global_model_has_no_stream_and_orders_nothing():
    server = parameter_server()
    assert server.cuda_stream is None
    with server.stream():
        pass
    server.after_caller()
    server.before_caller()


def test_the_server_stream_follows_the_training_stream_at_start_and_leads_it_at_join(
        monkeypatch):
    """The initial model is written on the training thread's stream, the merges on the
    server's, the final model read on the training thread's: each waits for the other."""
    log = []
    training = FakeStream("training", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: training)

    @contextlib.contextmanager
    def on(stream):
        log.append(f"server thread on {stream.name}")
        yield
    monkeypatch.setattr(torch.cuda, "stream", on)
    server = parameter_server()
    server.cuda_stream = FakeStream("server", log)
    server.live = set()            # the thread's loop ends at once
    thread = ServerThread(server, IdleEnd(), tick_s=0.01).start()
    thread.join(10)
    assert log == ["server waits for training", "server thread on server",
                   "training waits for server"]


def test_a_snapshot_is_a_host_copy_later_merges_do_not_reach():
    server = parameter_server(outer="nesterov(0.5, 0.9)")
    model, outer = server.snapshot()
    server.model.add_(1.0)
    server.outer.momentum.add_(1.0)
    assert torch.equal(model, torch.arange(6, dtype=torch.float32))
    assert model.device.type == "cpu" and outer["momentum"].device.type == "cpu"
    assert torch.equal(outer["momentum"], torch.zeros(6))
    assert outer["spec"] == str(server.outer.spec)


# ------------------------------------------------------------------ Horovod's GPU support

@pytest.mark.parametrize("built,gpu", [
    ({"cuda_built": True, "rocm_built": False, "nccl_built": 0}, True),    # MPI GPU ops
    ({"cuda_built": True, "rocm_built": False, "nccl_built": 21805}, True),
    ({"cuda_built": False, "rocm_built": True, "nccl_built": 0}, True),    # ROCm
    ({"nccl_built": True}, True),                       # a Horovod before cuda_built()
    ({"cuda_built": False, "rocm_built": False, "nccl_built": 0}, False),  # CPU ops only
    ({}, False),
])
def test_horovod_takes_gpu_tensors_when_built_with_gpu_operations(built, gpu):
    hvd = types.SimpleNamespace(**{name: (lambda v=v: v) for name, v in built.items()})
    assert horovod_gpu_operations(hvd) is gpu
    assert horovod_reduces_on(hvd, CUDA, "test") is gpu
    assert horovod_reduces_on(hvd, torch.device("cpu"), "test")


# ------------------------------------------------------------------ optimizer state

class RefusingHorovod:
    """A Horovod whose own broadcast must not be used."""

    def broadcast_optimizer_state(self, *args, **kwargs):
        raise AssertionError("Horovod was handed tensors it cannot take")


def adam():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def test_optimizer_state_goes_to_horovod_only_if_every_rank_can_hand_it_over(monkeypatch):
    calls = []
    hvd = types.SimpleNamespace(broadcast_optimizer_state=lambda opt, **kw: calls.append(kw))
    monkeypatch.setattr(functions, "_horovod", lambda: hvd)
    _, opt = adam()
    monkeypatch.setattr(functions, "_on_every_rank", lambda verdict: verdict)
    functions.broadcast_optimizer_state(opt, root_rank=0)
    assert calls == [{"root_rank": 0, "model": None}]
    # this rank's CPU tensors would do, another rank's GPU ones would not: neither uses it
    monkeypatch.setattr(functions, "_on_every_rank", lambda verdict: False)
    monkeypatch.setattr(functions, "_horovod", lambda: RefusingHorovod())
    monkeypatch.setattr(functions, "broadcast_parameters", lambda *a: None)
    functions.broadcast_optimizer_state(opt, root_rank=0)


def test_a_gpu_state_horovod_cannot_take_goes_through_host_memory(monkeypatch):
    """The decision for a CUDA model under a Horovod without GPU operations, on the CPU: the
    state is made (a step on zero gradients), its tensors and options broadcast apart."""
    monkeypatch.setattr(functions, "_horovod", lambda: RefusingHorovod())
    monkeypatch.setattr(functions, "_horovod_takes", lambda hvd, tensors: False)
    sent = {}
    monkeypatch.setattr(functions, "broadcast_parameters",
                        lambda tensors, root: sent.update(tensors))
    model, opt = adam()
    before = [p.detach().clone() for p in model.parameters()]
    functions.broadcast_optimizer_state(opt, root_rank=0)
    assert sorted(sent) == ["exp_avg.1", "exp_avg.2", "exp_avg_sq.1", "exp_avg_sq.2",
                            "step.1", "step.2"]
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.param_groups[0]["lr"] == 0.01


def test_state_values_and_options_land_in_their_places(monkeypatch):
    monkeypatch.setattr(functions, "_horovod", lambda: None)
    _, opt = adam()
    opt.param_groups[0]["lr"] = 0.5
    opt.state[opt.param_groups[0]["params"][1]]["note"] = "root's"
    _, values = functions._state_parts(opt)
    assert values[(0, None, "lr")] == 0.5 and "params" not in {k[2] for k in values}
    _, other = adam()
    other.step()     # nothing to do without gradients; the state stays empty
    for place, value in values.items():
        functions._assign(other, place, value)
    assert other.param_groups[0]["lr"] == 0.5
    assert other.state[other.param_groups[0]["params"][1]]["note"] == "root's"


def test_an_ashl_optimizers_state_is_made_by_its_own_class_not_its_strategy(monkeypatch):
    monkeypatch.setattr(functions, "_horovod", lambda: None)
    monkeypatch.setattr(functions, "broadcast_parameters", lambda *a: None)

    class Wrapped(torch.optim.SGD):
        _ashl = "a strategy"

        def step(self, closure=None):
            raise AssertionError("the strategy's step ran")

    model = torch.nn.Linear(2, 1)
    opt = Wrapped(model.parameters(), lr=0.1, momentum=0.9)
    functions.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(s["momentum_buffer"], torch.zeros_like(p))
               for p, s in opt.state.items())


def test_a_stateless_optimizer_broadcasts_nothing(monkeypatch):
    monkeypatch.setattr(functions, "_horovod", lambda: None)
    monkeypatch.setattr(functions, "broadcast_parameters",
                        lambda *a: pytest.fail("nothing to broadcast"))
    model = torch.nn.Linear(2, 1)
    functions.broadcast_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="LBFGS"):
        functions.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()))


# ------------------------------------------------------------------ staging buffers

def test_slightly_growing_payloads_reallocate_a_logarithmic_number_of_times():
    staging = WireStaging("cpu", staged=True)
    for nbytes in range(1000, 8001, 7):      # top-k payloads a little larger each commit
        buf = staging.host_buffer("send", nbytes)
        assert buf.numel() >= nbytes
    # 1000 -> 8000 at x1.5 a step: ceil(log_1.5 8) = 6 growths after the first allocation
    assert staging.allocations <= 7
    steady = staging.allocations
    for nbytes in range(7000, 8001, 3):
        staging.host_buffer("send", nbytes)
    assert staging.allocations == steady


def test_a_grown_buffer_leaves_the_payload_handed_out_intact():
    staging = WireStaging("cpu", staged=True)
    sent = staging.to_host_flat(torch.arange(10, dtype=torch.float32), "send")
    staging.host_buffer("send", 1000).fill_(255)       # grown: a new buffer
    assert torch.equal(sent, torch.arange(10, dtype=torch.float32))
    assert staging.host_buffer("send", 41).numel() == max(1000, int(40 * GROWTH))


# ------------------------------------------------------------------ the rank's device

class OneRank:
    def Get_rank(self):
        return 0

    def allgather(self, value):
        return [value]


@pytest.mark.parametrize("device,current", [("cuda:1", ["cuda:1"]), ("cpu", [])])
def test_a_ranks_gpu_becomes_its_current_device(monkeypatch, device, current):
    import ashl.device
    from ashl.train import rank_device
    chosen = []
    monkeypatch.setattr(ashl.device, "pick_device", lambda spec, *a: torch.device(device))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(str(d)))
    assert rank_device("auto", OneRank()) == torch.device(device)
    assert chosen == current
