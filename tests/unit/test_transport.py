"""ashl.transport's ZeroMQ ends in one process, on loopback (no MPI): exact bytes both ways
(the empty, one-byte, odd and multi-frame payloads), lost peers and a lost server, strangers
and malformed messages, a replacement's JOIN; pick_host; and the protocol's fault-tolerant
messages (JOIN, SUMMARY, DROPPED)."""

import dataclasses
import math
import socket
import threading
import time
from collections import namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from ashl import protocol, transport
from ashl.protocol import DType, Flag, Header, Kind, MessageBuffer, ProtocolError
from ashl.stages import Stage
from ashl.transport import JoinRequest, PeerLost, ServerLost, ZmqRankEnd, ZmqServerEnd

zmq = pytest.importorskip("zmq")

CHUNK = 8 << 20                 # transport._CHUNK: payload frames of at most 8 MiB
WAIT_S = 10.0                   # a bounded wait: only a hang fails on it
pytestmark = pytest.mark.timeout(60)


class Ends:
    """ZeroMQ ends on loopback, closed at the end of the test (each at most once)."""

    def __init__(self):
        self.open = []

    def server(self, world_size=2, numel=10, timeout_s=1.0):
        end = ZmqServerEnd(world_size, numel, heartbeat_s=0.2, timeout_s=timeout_s)
        self.open.append(end)
        return end

    def rank(self, server, rank=1, numel=10, world_size=2, server_rank=0, timeout_s=2.0, **kw):
        end = ZmqRankEnd(self.endpoint(server), rank, numel, world_size=world_size,
                         server_rank=server_rank, heartbeat_s=0.2, timeout_s=timeout_s, **kw)
        self.open.append(end)
        return end

    def raw(self, server, identity=None):
        """A bare DEALER that may send anything."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(self.endpoint(server))
        self.open.append((ctx, sock))
        return sock

    @staticmethod
    def endpoint(server):
        return f"tcp://127.0.0.1:{server.port}"

    def close(self, end):
        if end in self.open:
            self.open.remove(end)
            if isinstance(end, tuple):
                end[1].close(linger=0)
                end[0].term()
            else:
                end.close()

    def close_all(self):
        for end in reversed(list(self.open)):
            self.close(end)


@pytest.fixture
def ends():
    e = Ends()
    yield e
    e.close_all()


def poll(server, deadline_s=WAIT_S):
    """The server end's next event (bounded)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        event = server.poll(0.05)
        if event is not None:
            return event
    raise AssertionError(f"nothing arrived in {deadline_s} s")


def header(kind, rank, dtype, numel, nnz=0, **kw):
    return Header(kind=kind, rank=rank, stage=Stage.SHL, commit=5, base_version=11,
                  plan_version=2, epoch=1, local_steps=4, dtype=dtype, numel=numel, nnz=nnz,
                  samples=64, step_s=0.01, link_s=0.002, link_ratio=0.5, loss=0.25, **kw)


def random_bytes(n, seed=0):
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


# (kind from a rank, kind from the server, dtype, numel, nnz, model numel)
CASES = {
    "empty": (Kind.PLAN, Kind.REPLY, None, 0, 0, 10),
    "one byte": (Kind.PLAN, Kind.SUMMARY, DType.UINT8, 1, 0, 10),
    "odd": (Kind.JOIN, Kind.SUMMARY, DType.UINT8, 12345, 0, 10),
    "fp16": (Kind.DENSE_DELTA, Kind.REPLY, DType.FLOAT16, 4097, 0, 4097),
    "sparse": (Kind.SPARSE_DELTA, Kind.PLAN, DType.FLOAT32, 5000, 999, 5000),
    "one whole frame": (Kind.DENSE_DELTA, Kind.REPLY, DType.FLOAT32, CHUNK // 4, 0, CHUNK // 4),
    "past one frame": (Kind.DENSE_DELTA, Kind.REPLY, DType.FLOAT32, CHUNK // 4 + 3, 0,
                       CHUNK // 4 + 3),
    "three frames": (Kind.DENSE_DELTA, Kind.REPLY, DType.BFLOAT16, CHUNK + 7, 0, CHUNK + 7),
}


def case_message(name, to_server):
    up, down, dtype, numel, nnz, model = CASES[name]
    kind = up if to_server else down
    if dtype is None:     # nothing after the header: an empty PLAN up, a bare REPLY down
        dtype = DType.UINT8 if to_server else DType.NONE
    if kind == Kind.PLAN and nnz:      # the server's sparse case travels as bytes
        kind, dtype, numel, nnz = Kind.PLAN, DType.UINT8, nnz * 8, 0
    h = header(kind, 1 if to_server else 0, dtype, numel, nnz)
    return h, random_bytes(h.payload_nbytes, seed=numel), model


@pytest.mark.parametrize("name", list(CASES))
def test_a_message_arrives_byte_for_byte_both_ways(ends, name):
    h, payload, model = case_message(name, to_server=True)
    server = ends.server(numel=model)
    rank = ends.rank(server, numel=model)
    rank.send(h, payload if h.payload_nbytes else None)
    m = poll(server)
    assert isinstance(m, protocol.Message) and m.source == 1
    assert m.header == protocol.validate(h)
    assert m.payload.numel() == h.payload_nbytes and torch.equal(m.payload, payload)

    h, payload, _ = case_message(name, to_server=False)
    assert server.send(1, h, payload if h.payload_nbytes else None) is True
    buffer = MessageBuffer(max(h.payload_nbytes, 1))
    m = rank.recv(buffer)
    assert m.source == 0 and m.header == protocol.validate(h)
    assert m.payload.numel() == h.payload_nbytes and torch.equal(m.payload, payload)


class HandRolledDealer:
    """A rank's DEALER spoken by hand (ZMTP 3.0, NULL mechanism, over a plain TCP socket), so
    that the test decides when it reads: until it does, the server's frames stay with the
    server once the small kernel buffers are full."""

    def __init__(self, port, identity):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(("127.0.0.1", port))
        self.sock.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0")
                          + bytes(32))
        greeting = self._exact(64)
        assert greeting[0] == 0xFF and greeting[9] == 0x7F and greeting[12:16] == b"NULL"
        self._frame(b"\x05READY" + self._property(b"Socket-Type", b"DEALER")
                    + self._property(b"Identity", identity), command=True)
        command, body, _ = self._read_frame()
        assert command and body.startswith(b"\x05READY")

    @staticmethod
    def _property(name, value):
        return bytes([len(name)]) + name + len(value).to_bytes(4, "big") + value

    def _frame(self, body, more=False, command=False):
        long = len(body) > 255
        flags = int(more) | (2 if long else 0) | (4 if command else 0)
        size = len(body).to_bytes(8, "big") if long else bytes([len(body)])
        self.sock.sendall(bytes([flags]) + size + body)

    def _exact(self, n):
        out = bytearray(n)
        view, got = memoryview(out), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            assert k, "the server closed the connection"
            got += k
        return bytes(out)

    def _read_frame(self):
        flags = self._exact(1)[0]
        size = int.from_bytes(self._exact(8 if flags & 2 else 1), "big")
        return bool(flags & 4), self._exact(size), bool(flags & 1)

    def send(self, *frames):
        for i, f in enumerate(frames):
            self._frame(f, more=i < len(frames) - 1)

    def recv(self):
        """The next message's frames (heartbeat commands skipped)."""
        frames = []
        while True:
            command, body, more = self._read_frame()
            if command:
                continue
            frames.append(body)
            if not more:
                return frames

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("tail", [
    pytest.param(16, id="small last frame"),
    pytest.param(64 << 10, id="large last frame"),
    pytest.param(0, id="whole frames"),
])
def test_the_server_may_change_a_payload_once_send_returns(ends, tail):
    """ServerEnd.send's promise (as MPI_Send's): once it returns, the caller may change the
    buffer, here the global model. The rank reads only after the change, or after 0.3 s when
    send() keeps waiting for it, as it should."""
    numel = (3 * CHUNK + tail) // 4
    server = ZmqServerEnd(2, numel, heartbeat_s=5.0, timeout_s=5.0)
    ends.open.append(server)
    peer = HandRolledDealer(server.port, b"ashl-rank-1")
    try:
        peer.send(protocol.encode(header(Kind.PLAN, 1, DType.UINT8, 0)))
        assert poll(server).source == 1                   # the server knows the way back
        model = torch.zeros(numel)
        changed, frames = threading.Event(), []
        reader = threading.Thread(target=lambda: (changed.wait(0.3), frames.extend(peer.recv())))
        reader.start()
        assert server.send(1, header(Kind.REPLY, 0, DType.FLOAT32, numel), model)
        model.fill_(1.0)                                  # the next merge
        changed.set()
        reader.join(WAIT_S)
        assert not reader.is_alive()
    finally:
        peer.close()
    assert protocol.decode(frames[0], world_size=2, model_numel=numel).numel == numel
    got = torch.frombuffer(bytearray(b"".join(frames[1:])), dtype=torch.float32)
    assert got.numel() == numel
    assert not got.any(), f"{int(got.count_nonzero())} of {numel} values changed after send()"


def test_the_final_model_goes_without_a_copy_and_its_send_waits_until_it_is_written(ends):
    """The final model no longer changes: it is not copied, and its send returns once it
    is written out (the end may close after it), or False after timeout_s for a rank that
    does not read (here 0.5 s)."""
    numel = (3 * CHUNK + 16) // 4
    server = ZmqServerEnd(2, numel, heartbeat_s=5.0, timeout_s=0.5)
    ends.open.append(server)
    peer = HandRolledDealer(server.port, b"ashl-rank-1")
    try:
        peer.send(protocol.encode(header(Kind.PLAN, 1, DType.UINT8, 0)))
        assert poll(server).source == 1
        final, reply = torch.ones(numel), header(Kind.REPLY, 0, DType.FLOAT32, numel)
        assert server.send(1, reply, final, until_written=True) is False   # not read
        messages = []
        reader = threading.Thread(target=lambda: messages.extend([peer.recv(), peer.recv()]))
        reader.start()
        assert server.send(1, reply, final, until_written=True) is True
        reader.join(WAIT_S)
        assert not reader.is_alive()
    finally:
        peer.close()
    for frames in messages:
        got = torch.frombuffer(bytearray(b"".join(frames[1:])), dtype=torch.float32)
        assert got.numel() == numel and bool((got == 1.0).all())


def test_a_rank_that_reads_slowly_holds_up_no_other_ranks_reply(ends):
    """A slow link's rank takes its reply late (here it reads nothing until the next rank
    has its own): the send to it returns, and the next rank's reply arrives meanwhile.
    Before, the server waited until ZeroMQ had written out each reply (zero copy), up to
    timeout_s, so every commit queued behind the slowest rank's download (on shaped links:
    commit latency at the server, median 144-233 ms, p95 500 ms)."""
    numel = (3 * CHUNK + 16) // 4
    server = ZmqServerEnd(3, numel, heartbeat_s=5.0, timeout_s=5.0)
    ends.open.append(server)
    slow = HandRolledDealer(server.port, b"ashl-rank-1")
    fast = ends.rank(server, rank=2, numel=numel, world_size=3)
    try:
        slow.send(protocol.encode(header(Kind.PLAN, 1, DType.UINT8, 0)))
        fast.send(header(Kind.PLAN, 2, DType.UINT8, 0))
        assert {poll(server).source, poll(server).source} == {1, 2}
        model = torch.zeros(numel)
        reply = header(Kind.REPLY, 0, DType.FLOAT32, numel)
        assert server.send(1, reply, model)
        model.fill_(1.0)                                  # the next merge, at once
        assert server.send(2, reply, model)
        got = fast.recv(MessageBuffer(protocol.max_payload_nbytes(numel)))
        assert bool((got.dense() == 1.0).all())
        frames = slow.recv()                              # only now
    finally:
        slow.close()
    first = torch.frombuffer(bytearray(b"".join(frames[1:])), dtype=torch.float32)
    assert first.numel() == numel and not first.any()   # as it was when its send returned


@pytest.mark.timeout(20)
def test_a_ranks_send_does_not_wait_for_a_server_that_is_not_there(ends):
    """A rank's commit may sit queued for a gone server (a DEALER queues for ever): its send
    returns at once, even for a payload ZeroMQ does not copy."""
    with socket.socket() as s:                  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    numel = CHUNK // 4 + 5
    end = ZmqRankEnd(f"tcp://127.0.0.1:{port}", 1, numel, world_size=2, server_rank=0,
                     timeout_s=0.3)
    ends.open.append(end)
    end.send(header(Kind.DENSE_DELTA, 1, DType.FLOAT32, numel), torch.zeros(numel))
    with pytest.raises(ServerLost, match="could not reach"):
        end.recv(MessageBuffer(16))


@pytest.mark.timeout(20)
def test_a_send_with_no_server_to_queue_for_gives_up_after_the_timeout(ends):
    """The server rank's own end once the server's end has closed: no peer at all, so its
    send would block for ever (an overlapped commit's uploader must end, or the rank's end
    could not close): ServerLost after timeout_s."""
    server = ends.server()
    own = server.own_end(0)
    ends.open.append(own)
    own.timeout_s = 0.3
    ends.close(server)
    time.sleep(0.5)                     # ZeroMQ's I/O thread drops the pipe to it
    started = time.monotonic()
    with pytest.raises(ServerLost, match="could not send to the parameter server"):
        own.send(header(Kind.DENSE_DELTA, 0, DType.FLOAT32, 10), torch.zeros(10))
    assert time.monotonic() - started < WAIT_S


@pytest.mark.timeout(20)
def test_closing_the_client_ends_an_uploader_stuck_in_such_a_send_at_once(ends):
    """The run's end on the server rank: its server's end closes while an overlapped
    commit's uploader is in that send. The client's close() cancels it within one of the
    send's 0.25 s tries (before, it waited out the end's timeout_s, 5 s by default)."""
    from ashl.client import Commit, ServerClient
    from ashl.compression import Compression
    server = ends.server()
    own = server.own_end(0)
    ends.open.append(own)
    own.timeout_s = WAIT_S
    ends.close(server)
    time.sleep(0.5)                     # ZeroMQ's I/O thread drops the pipe to it
    client = ServerClient(own, 0, 10)
    client.begin(Compression.none.compress(torch.zeros(10)),
                 Commit(stage=Stage.AHL, number=0, base_version=0, plan_version=1, epoch=0,
                        local_steps=1))
    flight = client.inflight
    time.sleep(0.3)
    assert flight.uploader.is_alive()   # inside the send
    started = time.monotonic()
    client.close()
    assert not flight.uploader.is_alive() and time.monotonic() - started < 1.0
    assert flight.sent is False and flight.upload_error is None     # given up, not failed


def test_send_to_a_rank_that_never_connected_says_false(ends):
    server = ends.server(world_size=3, numel=10)
    rank = ends.rank(server, rank=1, world_size=3)
    rank.send(header(Kind.PLAN, 1, DType.UINT8, 0))
    poll(server)                                        # rank 1 is there, rank 2 is not
    model = header(Kind.REPLY, 0, DType.FLOAT32, 10)
    assert server.send(2, model, torch.zeros(10)) is False
    assert server.send(2, header(Kind.REPLY, 0, DType.NONE, 0)) is False
    assert server.send(b"ashl-join-nobody", model, torch.zeros(10)) is False
    assert server.send(1, model, torch.zeros(10)) is True


def test_a_closed_rank_end_is_reported_lost(ends):
    server = ends.server(world_size=3)
    one, two = ends.rank(server, rank=1, world_size=3), ends.rank(server, rank=2, world_size=3)
    for end, r in ((one, 1), (two, 2)):
        end.send(header(Kind.PLAN, r, DType.UINT8, 0))
        assert poll(server).source == r
    ends.close(two)
    event = poll(server)
    assert event == PeerLost(2, event.why) and "closed" in event.why
    deadline = time.monotonic() + WAIT_S    # its replies now fail, the other rank's do not
    while server.send(2, header(Kind.REPLY, 0, DType.NONE, 0)):
        assert time.monotonic() < deadline, "a reply to a gone rank kept succeeding"
        time.sleep(0.01)
    assert server.send(1, header(Kind.REPLY, 0, DType.NONE, 0)) is True
    assert one.recv(MessageBuffer(16)).header.kind == Kind.REPLY


def test_a_closed_server_end_makes_the_rank_end_raise_server_lost(ends):
    server = ends.server()
    rank = ends.rank(server)
    rank.send(header(Kind.PLAN, 1, DType.UINT8, 0))
    poll(server)
    server.send(1, header(Kind.REPLY, 0, DType.NONE, 0))
    ends.close(server)
    buffer = MessageBuffer(16)
    assert rank.recv(buffer).header.kind == Kind.REPLY   # what it sent before still lands
    with pytest.raises(ServerLost, match="connection closed"):
        rank.recv(buffer)


def test_a_server_that_is_not_there_is_lost_after_the_timeout(ends):
    with socket.socket() as s:                  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    end = ZmqRankEnd(f"tcp://127.0.0.1:{port}", 1, 10, world_size=2, server_rank=0,
                     timeout_s=0.3)
    ends.open.append(end)
    with pytest.raises(ServerLost, match="could not reach"):
        end.recv(MessageBuffer(16))


GOOD = header(Kind.PLAN, 1, DType.UINT8, 3)


@pytest.mark.parametrize("identity", [b"stranger", b"ashl-rank-7", b"ashl-rank-x",
                                      b"ashl-rank--1", b"ashl-rank-", None])
def test_a_stranger_is_refused(ends, identity):
    server = ends.server()
    raw = ends.raw(server, identity)
    raw.send_multipart([protocol.encode(GOOD), b"abc"])
    with pytest.raises(ProtocolError) as e:
        poll(server)
    assert e.value.field == "rank" and "unknown peer" in str(e.value)


def _frames(name):
    h = protocol.encode(GOOD)
    return {
        "short header": [b"short"],
        "long header": [h + b"x"],
        "garbage": [b"\x00" * protocol.HEADER_SIZE],
        "bad version": [h[:4] + b"\x63\x00" + h[6:]],
        "missing payload": [h],
        "short payload": [h, b"ab"],
        "long payload": [h, b"abcd"],
        "extra frame": [h, b"abc", b"d"],
        "bigger than the buffer": [h, bytes(2 << 20)],
        "another rank's header": [protocol.encode(GOOD.replace(rank=0)), b"abc"],
    }[name]


FIELDS = {"short header": "length", "long header": "length", "garbage": "magic",
          "bad version": "version", "missing payload": "length", "short payload": "length",
          "long payload": "length", "extra frame": "length", "bigger than the buffer": "length",
          "another rank's header": "rank"}


@pytest.mark.parametrize("name", list(FIELDS))
def test_a_malformed_message_is_refused_and_the_stream_stays_in_step(ends, name):
    server = ends.server()
    raw = ends.raw(server, b"ashl-rank-1")
    raw.send_multipart(_frames(name))
    raw.send_multipart([protocol.encode(GOOD), b"xyz"])
    with pytest.raises(ProtocolError) as e:
        poll(server)
    assert e.value.field == FIELDS[name]
    m = poll(server)                                    # the next message is whole
    assert m.header == protocol.validate(GOOD) and bytes(m.payload.numpy()) == b"xyz"


def join_request(numel=10):
    body = protocol.json_payload({"compute_s": 0.02, "host": "spare", "numel": numel})
    return Header(kind=Kind.JOIN, rank=0, dtype=DType.UINT8, numel=body.size), body


def ask_to_join(ends, server, server_rank=0):
    """A replacement's end, and the JOIN it sent as the server received it."""
    _, joiner = transport.open_ends(None, server_rank, 10, fault_tolerant=True, timeout_s=2.0,
                                    join=ends.endpoint(server))
    ends.open.append(joiner)
    joiner.send(*join_request())
    return joiner, poll(server)


def test_a_join_comes_back_as_a_join_request_that_can_be_answered(ends):
    server = ends.server(world_size=3, numel=10)
    joiner, request = ask_to_join(ends, server)
    assert isinstance(request, JoinRequest)
    assert request.peer.startswith(b"ashl-join-")
    assert request.message.header.kind == Kind.JOIN
    assert request.message.json() == {"compute_s": 0.02, "host": "spare", "numel": 10}
    answer = protocol.json_payload({"rank": 2, "size": 3, "server_rank": 0})
    assert server.send(request.peer, Header(kind=Kind.SUMMARY, rank=0, dtype=DType.UINT8,
                                            numel=answer.size), answer)
    model = torch.arange(10, dtype=torch.float32)
    assert server.send(request.peer, header(Kind.REPLY, 0, DType.FLOAT32, 10), model)
    buffer = MessageBuffer(protocol.MAX_PLAN_BYTES)
    assert joiner.recv(buffer).json() == {"rank": 2, "size": 3, "server_rank": 0}
    assert torch.equal(joiner.recv(buffer).dense(), model)


def test_a_replacement_may_only_ask_to_join(ends):
    server = ends.server()
    raw = ends.raw(server, transport.join_identity())
    raw.send_multipart([protocol.encode(GOOD), b"abc"])
    with pytest.raises(ProtocolError) as e:
        poll(server)
    assert e.value.field == "kind"


def test_a_replacement_can_join_a_server_that_is_not_on_rank_0(ends):
    server = ends.server(world_size=3, numel=10)
    joiner, request = ask_to_join(ends, server, server_rank=1)
    answer = protocol.json_payload({"rank": 2, "size": 3, "server_rank": 1})
    server.send(request.peer, Header(kind=Kind.SUMMARY, rank=1, dtype=DType.UINT8,
                                     numel=answer.size), answer)
    assert joiner.recv(MessageBuffer(protocol.MAX_PLAN_BYTES)).json()["server_rank"] == 1


def test_join_identities_are_unique_and_never_a_rank():
    a, b = transport.join_identity(), transport.join_identity()
    assert a != b and a.startswith(b"ashl-join-") and transport._rank_of(a) is None
    assert transport._rank_of(transport.rank_identity(12)) == 12
    assert transport.rank_identity(12) != transport.rank_identity(12)   # a nonce each


# ----------------------------------------------------------------------- pick_host


Addr = namedtuple("Addr", "family address netmask broadcast ptp")   # psutil's snicaddr


def fake_interfaces(monkeypatch, *addresses):
    """This host's interfaces, as psutil.net_if_addrs() would give them."""
    import psutil
    table = {"lo": [Addr(socket.AF_INET, "127.0.0.1", "255.0.0.0", None, None)]}
    for i, (address, netmask) in enumerate(addresses):
        table[f"eth{i}"] = [Addr(socket.AF_INET, address, netmask, None, None),
                            Addr(socket.AF_INET6, "fe80::1", None, None, None)]
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: table)


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv("ASHL_SERVER_HOST", raising=False)


def test_ashl_server_host_overrides(monkeypatch):
    fake_interfaces(monkeypatch, ("10.1.2.3", "255.255.0.0"))
    monkeypatch.setenv("ASHL_SERVER_HOST", "head-node.example")
    assert transport.pick_host(["10.1.2.3", "127.0.0.1"], transport.host_identity()) \
        == "head-node.example"
    monkeypatch.setenv("ASHL_SERVER_HOST", "")            # empty: not set
    assert transport.pick_host(["10.1.2.3"], transport.host_identity()) == "127.0.0.1"


OTHER_HOST = "another-boot-id:4026531840"


@pytest.mark.parametrize("hosts,server,expected", [
    (["10.1.2.3", "127.0.0.1"], "here", "127.0.0.1"),     # the server shares our loopback
    (["172.17.0.1", "10.1.9.9"], OTHER_HOST, "10.1.9.9"),  # an address we also have (docker0)
    (["127.0.0.1"], OTHER_HOST, "127.0.0.1"),              # only loopback
    (["127.0.1.1", "127.0.0.1"], OTHER_HOST, "127.0.0.1"),
    (["192.168.7.7", "10.1.9.9", "127.0.0.1"], OTHER_HOST, "10.1.9.9"),   # on one of our subnets
    (["192.168.7.7", "172.16.0.1"], OTHER_HOST, "192.168.7.7"),           # else the first
], ids=["same host", "same address, other host", "loopback", "loopbacks", "subnet", "first"])
def test_pick_host(monkeypatch, no_override, hosts, server, expected):
    fake_interfaces(monkeypatch, ("10.1.2.3", "255.255.0.0"), ("172.17.0.1", "255.255.0.0"))
    server = transport.host_identity() if server == "here" else server
    assert transport.pick_host(hosts, server) == expected


def test_the_host_identity_tells_network_namespaces_apart():
    here = transport.host_identity()
    assert here == transport.host_identity() and ":" in here


def test_advertised_hosts_put_loopback_last(monkeypatch):
    fake_interfaces(monkeypatch, ("10.1.2.3", "255.255.0.0"), ("10.9.0.1", "255.255.255.0"))
    hosts = transport.advertised_hosts()
    assert hosts[-1] == "127.0.0.1" and set(hosts) == {"127.0.0.1", "10.1.2.3", "10.9.0.1"}


# ------------------------------------------------ protocol: JOIN, SUMMARY, DROPPED


def plain(h):
    """A header's fields, NaN ("not measured") as None so that equal headers compare equal."""
    return tuple(None if isinstance(v, float) and math.isnan(v) else v
                 for v in dataclasses.astuple(h))


def buffered(h, body):
    buf = MessageBuffer(max(body.size, 1))
    buf.array[:protocol.HEADER_SIZE] = np.frombuffer(protocol.encode(h), dtype=np.uint8)
    buf.array[protocol.HEADER_SIZE:protocol.HEADER_SIZE + body.size] = body
    return buf


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@pytest.mark.parametrize("kind", [Kind.JOIN, Kind.SUMMARY])
@given(obj=json_values)
def test_join_and_summary_carry_json(kind, obj):
    body = protocol.json_payload(obj)
    h = Header(kind=kind, rank=2, stage=Stage.SHL, dtype=DType.UINT8, numel=body.size)
    decoded = protocol.decode(protocol.encode(h), world_size=4, model_numel=10)
    assert plain(decoded) == plain(protocol.validate(h)) and decoded.kind is kind
    m = protocol.received(buffered(h, body), h.nbytes, 2, world_size=4, model_numel=10)
    assert m.json() == obj


@pytest.mark.parametrize("kind", [Kind.JOIN, Kind.SUMMARY])
@pytest.mark.parametrize("dtype", [DType.NONE, DType.FLOAT32, DType.FLOAT16])
def test_join_and_summary_carry_only_bytes(kind, dtype):
    with pytest.raises(ProtocolError) as e:
        protocol.encode(Header(kind=kind, rank=0, dtype=dtype, numel=4))
    assert e.value.field == "dtype"


@pytest.mark.parametrize("kind", [Kind.JOIN, Kind.SUMMARY])
def test_a_summary_or_join_over_max_plan_bytes_is_refused(kind):
    ok = Header(kind=kind, rank=0, dtype=DType.UINT8, numel=protocol.MAX_PLAN_BYTES)
    decoded = protocol.decode(protocol.encode(ok), world_size=1, model_numel=1)
    assert plain(decoded) == plain(protocol.validate(ok))
    too_big = ok.replace(numel=protocol.MAX_PLAN_BYTES + 1)
    with pytest.raises(ProtocolError) as e:
        protocol.encode(too_big)
    assert e.value.field == "numel"
    fields = list(protocol._LAYOUT.unpack(protocol.encode(ok)[:protocol._LAYOUT.size]))
    assert fields[13] == protocol.MAX_PLAN_BYTES       # and on the wire: numel, patched
    fields[13] = protocol.MAX_PLAN_BYTES + 1
    raw = protocol._LAYOUT.pack(*fields) + bytes(protocol.HEADER_SIZE - protocol._LAYOUT.size)
    with pytest.raises(ProtocolError) as e:
        protocol.decode(bytes(raw), world_size=1, model_numel=1)
    assert e.value.field == "numel"


def test_a_summary_that_is_not_json_is_named():
    body = np.frombuffer(b"\xff{", dtype=np.uint8)
    h = Header(kind=Kind.SUMMARY, rank=0, dtype=DType.UINT8, numel=2)
    m = protocol.received(buffered(h, body), h.nbytes, 0, world_size=1, model_numel=1)
    with pytest.raises(ProtocolError) as e:
        m.json()
    assert e.value.field == "payload"


@pytest.mark.parametrize("flags", [Flag.DROPPED, Flag.STOP | Flag.DROPPED,
                                   Flag.ACCEPTED | Flag.STOP | Flag.PLAN_FOLLOWS | Flag.DROPPED])
def test_dropped_is_a_flag_a_reply_may_carry(flags):
    h = Header(kind=Kind.REPLY, rank=0, stage=Stage.AHL, dtype=DType.FLOAT32, numel=10, flags=flags)
    decoded = protocol.decode(protocol.encode(h), world_size=2, model_numel=10)
    assert decoded.flags == flags and decoded.flags & Flag.DROPPED
    with pytest.raises(ProtocolError) as e:
        protocol.encode(h.replace(flags=int(flags) | 32))
    assert e.value.field == "flags"


# ------------------------------------------------------- the rank's non-blocking poll

def test_a_rank_end_polls_for_its_reply_without_waiting(ends):
    server = ends.server()
    rank = ends.rank(server)
    assert rank.poll(0.0) is False                # nothing sent to it: at once, no wait
    rank.send(header(Kind.PLAN, 1, DType.UINT8, 0))
    poll(server)
    assert rank.poll(0.0) is False                # its reply has not been sent yet
    server.send(1, header(Kind.REPLY, 0, DType.NONE, 0))
    deadline = time.monotonic() + WAIT_S
    while not rank.poll(0.05):
        assert time.monotonic() < deadline, "the reply never showed in poll"
    assert rank.poll(0.0) is True                 # still there until it is received
    assert rank.recv(MessageBuffer(16)).header.kind == Kind.REPLY
    assert rank.poll(0.0) is False


def test_a_rank_ends_poll_waits_idle_for_its_whole_timeout(ends):
    """One wait in ZeroMQ's poller for a timeout of whole milliseconds, not a wait rounded
    down and then poll(0) calls for the rest (a spin: an overlapped commit's watcher polls
    in slices for the whole flight)."""
    server = ends.server()
    rank = ends.rank(server)
    rank.send(header(Kind.PLAN, 1, DType.UINT8, 0))
    poll(server)                                  # connected, and nothing sent back
    waits = []
    poller_poll = rank.poller.poll
    rank.poller.poll = lambda timeout=None: waits.append(timeout) or poller_poll(timeout)
    for _ in range(5):
        assert rank.poll(0.0503) is False
    assert waits.count(0) == 0 and len(waits) <= 10, waits


def test_the_server_ends_poll_waits_out_a_fraction_of_a_millisecond(ends):
    """The server thread polls until its next tick: under a millisecond before it, a wait
    rounded down to 0 returned at once, and the loop spun until the tick."""
    server = ends.server()
    waits = []
    poller_poll = server.poller.poll
    server.poller.poll = lambda timeout=None: waits.append(timeout) or poller_poll(timeout)
    assert server.poll(0.0004) is None and server.poll(0.0) is None
    assert waits == [1, 0]


def a_rank_whose_server_closed(ends):
    """A rank end that reached its server, which then closed."""
    server = ends.server()
    rank = ends.rank(server)
    rank.send(header(Kind.PLAN, 1, DType.UINT8, 0))
    poll(server)
    ends.close(server)
    return rank


@pytest.mark.timeout(60)   # the bug this pins was a recv that waited for ever
def test_a_disconnect_that_poll_read_still_ends_the_next_recv(ends):
    # An overlapped commit polls between steps, then waits at its round's end: the poll may
    # read the disconnect event before DRAIN_S is over, and the recv after it sees no event.
    rank = a_rank_whose_server_closed(ends)
    deadline = time.monotonic() + WAIT_S
    while rank.lost_at is None and time.monotonic() < deadline:
        assert rank.poll(0.01) is False
    assert rank.lost_at is not None, "the disconnect was never seen"
    with pytest.raises(ServerLost, match=r"lost the parameter server \(rank 0"):
        rank.recv(MessageBuffer(16))


def test_a_rank_end_polling_a_closed_server_raises_server_lost(ends):
    rank = a_rank_whose_server_closed(ends)
    deadline = time.monotonic() + WAIT_S
    with pytest.raises(ServerLost, match="connection closed"):
        while time.monotonic() < deadline:
            rank.poll(0.05)


# --- MPIServerEnd in-process (COMM_SELF: the server and its rank are this process) ---------

@pytest.fixture
def self_end():
    pytest.importorskip("mpi4py")
    from mpi4py import MPI
    numel = 1 << 16        # 256 KiB replies: sent in rendezvous, so a send waits for its receive
    end = transport.MPIServerEnd(MPI.COMM_SELF, numel)
    yield end, numel, MPI.COMM_SELF
    end.close()


def received_reply(comm, numel):
    buffer = MessageBuffer(4 * numel)
    return protocol.recv(comm, buffer, source=0, tag=protocol.TAG_TO_RANK, model_numel=numel)


@pytest.mark.timeout(30)
def test_an_mpi_reply_is_the_model_as_sent_and_its_copy_is_reused(self_end):
    end, numel, comm = self_end
    model = torch.zeros(numel)
    for version in (1, 2):
        model.fill_(version)
        end.send(0, header(Kind.REPLY, 0, DType.FLOAT32, numel), model)
        copy = end.outstanding[-1][1]
        model.fill_(-1.0)                        # the next merge, before the rank reads
        reply = received_reply(comm, numel)
        assert float(reply.dense().min()) == float(reply.dense().max()) == version
        end.drain()
        assert end.outstanding == [] and end.spare[-1] is copy
    end.send(0, header(Kind.REPLY, 0, DType.FLOAT32, numel), model)
    assert end.outstanding[-1][1] is copy and end.spare == []   # the same buffer again
    received_reply(comm, numel)


@pytest.mark.timeout(30)
def test_a_closed_mpi_end_keeps_the_copy_of_a_reply_not_yet_read(self_end):
    end, numel, comm = self_end
    model = torch.full((numel,), 3.0)
    end.send(0, header(Kind.REPLY, 0, DType.FLOAT32, numel), model)
    request, copy = end.outstanding[0]
    end.close()
    assert end.outstanding == [] and protocol._PENDING[-1][1] is copy
    try:
        reply = received_reply(comm, numel)      # MPI reads the kept copy
        request.Wait()
        assert float(reply.dense().min()) == 3.0
    finally:
        protocol._PENDING.pop()


# --- MPIRankEnd in-process ------------------------------------------------------------------

def rank_end(comm, numel, server_error=lambda: None):
    return transport.MPIRankEnd(comm, 0, numel, server_error=server_error)


def commit_header(numel):
    return header(Kind.DENSE_DELTA, 0, DType.FLOAT32, numel)


@pytest.mark.timeout(30)
def test_an_mpi_commit_and_its_reply_travel_between_the_ends(self_end):
    end, numel, comm = self_end
    rank = rank_end(comm, numel)
    delta = torch.arange(numel, dtype=torch.float32)
    sent = {}
    sender = threading.Thread(target=lambda: sent.update(ok=rank.send(commit_header(numel), delta)),
                              daemon=True)
    sender.start()                    # a rendezvous send: it waits for the server's receive
    message = None
    while message is None:
        message = end.poll(0.1)
    sender.join(10)
    assert sent == {"ok": True} and torch.equal(message.dense(), delta)
    end.send(0, header(Kind.REPLY, 0, DType.FLOAT32, numel), delta + 1)
    reply = rank.recv(MessageBuffer(4 * numel))
    assert torch.equal(reply.dense(), delta + 1)
    end.drain()


@pytest.mark.timeout(30)
def test_an_mpi_commit_cancelled_before_it_leaves_is_not_sent(self_end):
    _, numel, comm = self_end
    cancelled = threading.Event()
    cancelled.set()
    assert rank_end(comm, numel).send(commit_header(numel), torch.zeros(numel),
                                      cancelled=cancelled) is False
    assert not comm.Iprobe(source=0, tag=protocol.TAG_TO_SERVER)


@pytest.mark.timeout(30)
def test_an_mpi_commit_to_a_dead_server_thread_raises_server_lost(self_end):
    """The server rank's own commit goes to itself: once its server thread has died, the
    commit ends with ServerLost instead of a send that no one will ever receive."""
    _, numel, comm = self_end
    rank = rank_end(comm, numel, server_error=lambda: RuntimeError("merge failed"))
    with pytest.raises(ServerLost, match="parameter server failed"):
        rank.send(commit_header(numel), torch.full((numel,), 5.0))
    assert not comm.Iprobe(source=0, tag=protocol.TAG_TO_SERVER)


def take_abandoned_commit(comm, numel):
    """The commit a given-up send left pending, received (MPI may still deliver it), and
    its kept buffers released."""
    request = protocol._PENDING[-1][0]
    try:
        message = protocol.recv(comm, MessageBuffer(4 * numel), source=0,
                                tag=protocol.TAG_TO_SERVER, model_numel=numel)
        request.Wait()
        return message
    finally:
        protocol._PENDING.pop()


@pytest.mark.timeout(30)
def test_the_server_ranks_commit_to_itself_ends_when_its_server_thread_dies_meanwhile(self_end):
    """Its server thread dies while the commit waits for its receive: ServerLost, not a
    send that waits for ever (the training thread would join its uploader for ever)."""
    _, numel, comm = self_end
    died = []
    rank = rank_end(comm, numel, server_error=lambda: died[0] if died else None)
    timer = threading.Timer(0.2, lambda: died.append(RuntimeError("merge failed")))
    timer.start()
    with pytest.raises(ServerLost, match="parameter server failed"):
        rank.send(commit_header(numel), torch.full((numel,), 5.0))
    timer.join()
    assert float(take_abandoned_commit(comm, numel).dense().max()) == 5.0


@pytest.mark.timeout(30)
def test_the_server_ranks_commit_to_itself_is_given_up_when_cancelled_meanwhile(self_end):
    """A closing client cancels the commit while it waits for a receive that will not come."""
    _, numel, comm = self_end
    cancelled = threading.Event()
    timer = threading.Timer(0.2, cancelled.set)
    timer.start()
    assert rank_end(comm, numel).send(commit_header(numel), torch.full((numel,), 2.0),
                                      cancelled=cancelled) is False
    timer.join()
    assert float(take_abandoned_commit(comm, numel).dense().min()) == 2.0
