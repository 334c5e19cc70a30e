"""transport="zmq"|"mpi" (no MPI here): the server rank's own end over inproc, the ZeroMQ
server end in a fail-stop run, the context the two ends share, a ServerThread serving its own
rank in-process (and the statistics it keeps), and the option checks of every entry point."""

import threading
import time

import pytest
import torch
from test_transport import poll  # noqa: E402 (a sibling test module)

from ashl import transport
from ashl.cli import OptionError, check_transport
from ashl.coordinator import Coordinator, DriftConfig
from ashl.planner import PlannerConfig, RankProfile
from ashl.protocol import DType, Flag, Header, Kind, MessageBuffer
from ashl.server import ParameterServer, ServerThread
from ashl.stages import Stage, StageConfig
from ashl.strategies import (DEFAULT_TRANSPORT, FAULT_TOLERANT, PARAMETER_SERVER, STRATEGIES,
                             TRANSPORTS, transport_problem)
from ashl.strategies.parameter_server import check_transport as strategy_check
from ashl.torch.optimizer import _strategy_options
from ashl.transport import LostPeerError, PeerLost, ZmqRankEnd, ZmqServerEnd

zmq = pytest.importorskip("zmq")
pytestmark = pytest.mark.timeout(60)
WAIT_S = 10.0     # a bounded wait: only a hang fails on it


def delta(rank, numel, value=1.0, commit=0):
    h = Header(kind=Kind.DENSE_DELTA, rank=rank, stage=Stage.AHL, commit=commit,
               plan_version=1, dtype=DType.FLOAT32, numel=numel, step_s=0.01, loss=1.0)
    return h, torch.full((numel,), value)


@pytest.fixture
def server():
    end = ZmqServerEnd(2, 1000, heartbeat_s=0.2, timeout_s=1.0, fault_tolerant=False)
    yield end
    if not end.sock.closed:
        end.close()


# ----------------------------------------------------------------- the in-process path

def test_the_server_ranks_own_end_is_inproc_byte_for_byte(server):
    own = server.own_end(0)
    try:
        assert own.endpoint == server.inproc and own.endpoint.startswith("inproc://")
        h, x = delta(0, 1000, commit=3)
        own.send(h, x)
        got = poll(server)
        assert got.header.rank == 0 and torch.equal(got.dense(), x)
        assert server.fd_identity == {}            # no connection: nothing that can be lost
        y = torch.randn(1000)
        reply = Header(kind=Kind.REPLY, rank=0, stage=Stage.AHL, dtype=DType.FLOAT32,
                       numel=1000, base_version=4, flags=Flag.ACCEPTED)
        sent = []
        sender = threading.Thread(target=lambda: sent.append(server.send(0, reply, y)))
        sender.start()
        answer = own.recv(MessageBuffer(4000))
        sender.join(WAIT_S)
        assert sent == [True] and answer.header.base_version == 4
        assert torch.equal(answer.dense(), y)
    finally:
        own.close()


def test_a_reply_to_the_own_rank_is_sent_before_that_rank_reads_it(server):
    """An overlapped server rank reads its reply only between its steps: the server thread
    must not stand still until then, holding every other rank's reply. send() gives the reply
    to ZeroMQ as a copy (a zero-copy frame over inproc is held until read: send would wait
    out timeout_s and return False), so the global model may change at once."""
    own = server.own_end(0)
    try:
        own.send(*delta(0, 1000))
        poll(server)
        model = torch.arange(1000, dtype=torch.float32)
        reply = Header(kind=Kind.REPLY, rank=0, stage=Stage.AHL, dtype=DType.FLOAT32,
                       numel=1000, base_version=1, flags=Flag.ACCEPTED)
        assert server.send(0, reply, model) is True      # nobody has read it yet
        model.fill_(-1.0)                                 # the next merge
        answer = own.recv(MessageBuffer(4000))
        assert torch.equal(answer.dense(), torch.arange(1000, dtype=torch.float32))
    finally:
        own.close()


def test_an_inproc_end_waits_past_the_timeout_for_a_held_reply(server):
    """A held SHL reply may come after any time; an inproc end has no connect event, and
    must not take the wait for an unreachable server."""
    own = server.own_end(0)
    try:
        own.send(*delta(0, 1000))
        poll(server)
        reply = Header(kind=Kind.REPLY, rank=0, stage=Stage.SHL, dtype=DType.NONE)
        timer = threading.Timer(2.5 * server.timeout_s, lambda: server.send(0, reply))
        timer.start()
        assert own.recv(MessageBuffer(16)).header.kind == Kind.REPLY
        timer.join()
    finally:
        own.close()


def test_closing_either_end_first_never_waits_for_the_other(server):
    """The server thread closes its end when it fails, the training thread's may still be
    open (and the other order at the normal end): the shared context ends with the last."""
    own = server.own_end(0)
    context = server.context
    server.close()                  # returns at once (a wait here would hang the test)
    assert not context.closed
    own.server_error = lambda: RuntimeError("gone")   # how its training thread learns it
    with pytest.raises(transport.ServerLost, match="failed"):
        own.recv(MessageBuffer(16))
    own.close()
    assert context.closed


# ------------------------------------------------------------------ fail-stop over zmq

def rank_end(server, rank=1):
    return ZmqRankEnd(f"tcp://127.0.0.1:{server.port}", rank, server.model_numel,
                      world_size=server.world_size, server_rank=0, heartbeat_s=0.2,
                      timeout_s=1.0)


@pytest.mark.parametrize("tolerant", [False, True])
def test_a_lost_rank_fails_a_fail_stop_server_end_and_is_reported_by_a_tolerant_one(tolerant):
    server = ZmqServerEnd(2, 10, heartbeat_s=0.2, timeout_s=1.0, fault_tolerant=tolerant)
    end = rank_end(server)
    try:
        end.send(Header(kind=Kind.PLAN, rank=1, dtype=DType.UINT8))
        assert poll(server).source == 1
        end.close()
        if tolerant:
            assert isinstance(poll(server), PeerLost)
        else:
            with pytest.raises(LostPeerError, match="lost rank 1: .*fail-stop"):
                poll(server)
    finally:
        server.close()


def test_a_fail_stop_server_thread_that_loses_a_rank_fails_and_its_own_rank_sees_it():
    numel = 8
    end = ZmqServerEnd(2, numel, heartbeat_s=0.2, timeout_s=1.0, fault_tolerant=False)
    thread = ServerThread(parameter_server(2, numel), end, tick_s=0.05)
    own = end.own_end(0, server_error=lambda: thread.error)
    other = rank_end(end)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not end.fd_identity:       # the server thread has seen rank 1's HELLO
            assert time.monotonic() < deadline, "rank 1's HELLO never reached the server"
            time.sleep(0.01)
        other.close()
        thread._thread.join(WAIT_S)
        assert isinstance(thread.error, LostPeerError)
        with pytest.raises(transport.ServerLost):
            own.send(*delta(0, numel))
            own.recv(MessageBuffer(4 * numel))
        with pytest.raises(RuntimeError, match="the parameter server failed"):
            thread.join()
    finally:
        own.close()


# ----------------------------------------------- a server thread serving its own rank

def parameter_server(n, numel):
    coordinator = Coordinator(n, PlannerConfig(), StageConfig(switch_loss=-1.0, max_commits=3),
                              DriftConfig(enabled=False))
    coordinator.plan_from_profiles([RankProfile(compute_s=0.01, push_s=0.001, pull_s=0.001)
                                    for _ in range(n)])
    return ParameterServer(torch.zeros(numel), n, coordinator, rank=0)


def test_a_server_thread_serves_its_own_rank_in_process_and_times_the_commits():
    numel = 16
    end = ZmqServerEnd(1, numel, heartbeat_s=0.2, timeout_s=1.0, fault_tolerant=False)
    thread = ServerThread(parameter_server(1, numel), end, tick_s=0.05)
    own = end.own_end(0, server_error=lambda: thread.error)
    thread.start()
    buffer = MessageBuffer(4 * numel)
    try:
        replies = []
        for commit in range(3):      # the commit budget: the third reply says STOP
            own.send(*delta(0, numel, commit=commit))
            replies.append(own.recv(buffer).header)
        thread.join(WAIT_S)
    finally:
        own.close()
        end.close()
    assert [bool(h.flags & Flag.STOP) for h in replies] == [False, False, True]
    assert torch.equal(thread.server.model, torch.full((numel,), 3.0))  # merge weight 1
    stats = thread.server.stats.to_dict()
    latency = stats["commit_latency"]
    assert latency["count"] == latency["samples"] == 3
    assert 0 < latency["median_ms"] <= latency["p95_ms"]
    assert stats["thread_wall_s"] > 0 and 0 <= stats["busy_fraction"] <= 1
    assert "latency_ms" not in stats      # the samples stay in the server


# ------------------------------------------------------------------ the option checks

def test_the_transport_names_and_default():
    assert TRANSPORTS == ("zmq", "mpi") and DEFAULT_TRANSPORT == "zmq"
    assert set(FAULT_TOLERANT) <= set(PARAMETER_SERVER) <= set(STRATEGIES)


@pytest.mark.parametrize("name,tolerant,needle", [
    ("zmq", False, None), ("mpi", False, None), ("zmq", True, None),
    ("mpi", True, "fault-tolerant run needs transport 'zmq'"),
    ("tcp", False, "unknown transport 'tcp'"), (None, False, "unknown transport None"),
])
def test_a_transport_is_known_and_zmq_when_fault_tolerant(name, tolerant, needle):
    problem = transport_problem(name, tolerant)
    assert (problem is None) == (needle is None)
    if needle:
        assert needle in problem
        with pytest.raises(ValueError, match=needle):
            strategy_check(name, tolerant)
        if name is not None:          # on a command line None is "not given"
            with pytest.raises(OptionError, match=f"^--transport {name!r}: "):
                check_transport(name, "ashl", tolerant)
    else:
        assert strategy_check(name, tolerant) == name
        check_transport(name, "ashl", tolerant)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_only_the_parameter_server_strategies_take_a_transport(strategy):
    if strategy in PARAMETER_SERVER:
        check_transport("mpi", strategy)
        assert _strategy_options(strategy, 3, {"transport": "mpi"})["transport"] == "mpi"
        return
    with pytest.raises(OptionError, match=f"strategy {strategy} has no parameter server"):
        check_transport("mpi", strategy)
    with pytest.raises(ValueError, match=f"strategy {strategy!r} has no parameter server"):
        _strategy_options(strategy, 3, {"transport": "zmq"})
    check_transport(None, strategy)          # not given: nothing to refuse


def test_open_ends_refuses_mpi_for_a_fault_tolerant_run_before_any_collective():
    with pytest.raises(ValueError, match="'mpi'"):
        transport.open_ends(None, 0, 10, transport="mpi", fault_tolerant=True)
    with pytest.raises(ValueError, match="'tcp'"):
        transport.open_ends(None, 0, 10, transport="tcp")


def test_a_zero_copy_commit_still_goes_out_from_an_exit_hook_registered_after_the_ends():
    """ashl's leave-at-exit hook is registered once the ends exist and sends the last
    commits at exit: pyzmq's garbage collector (zero-copy sends) must still be up then."""
    import subprocess
    import sys
    script = """
import atexit, torch
from ashl.protocol import DType, Header, Kind
from ashl.stages import Stage
from ashl.transport import ZmqServerEnd
numel = 1 << 16        # past the copy threshold: a zero-copy send
server = ZmqServerEnd(1, numel, heartbeat_s=0.2, timeout_s=1.0, fault_tolerant=False)
own = server.own_end(0)
def commit():
    own.send(Header(kind=Kind.DENSE_DELTA, rank=0, stage=Stage.AHL, dtype=DType.FLOAT32,
                    numel=numel), torch.zeros(numel))
def last_commit():
    commit()
    print("sent", flush=True)
atexit.register(last_commit)
commit()               # training: zero-copy commits after the hook was registered
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert "sent" in proc.stdout, proc.stderr[-3000:]
