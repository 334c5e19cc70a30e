"""How commits and replies travel: one interface, two transports (``transport=``).

The server's end (``ServerEnd``) waits for the next commit or for news that a peer is gone,
and sends replies; a rank's end (``RankEnd``) sends its commit and waits for the answer.
Both carry exactly the messages of protocol.py (one 128-byte header, then the payload).

- ``zmq`` (the default, and the only one of a fault-tolerant run): a ROUTER socket on the
  server rank, one DEALER per rank, every wait a blocking ``zmq.Poller`` (no core spent
  waiting). The ROUTER binds TCP for the other ranks and ``inproc://`` for the server rank's
  own DEALER (one context shared in the process), so that rank's commits never leave the
  process. A dead process closes its TCP connection, and the ROUTER's socket monitor reports
  the disconnect at once (the connection's file descriptor, mapped to the rank whose
  messages came through it); a silent one (a host gone, a frozen process) stops answering
  the ZMTP heartbeats and is disconnected after ``timeout_s``. A rank sees the server's
  disconnect the same way, through a socket monitor. A fault-tolerant server end reports a
  lost peer (``PeerLost``); a fail-stop one raises ``LostPeerError``, which ends the run as
  Open MPI ends a run whose rank died. Under ``mpirun --enable-recovery`` MPI traffic towards
  a dead rank can deadlock Open MPI's TCP transport; ZeroMQ's cannot (docs/LAUNCHING.md).
- ``mpi``: point-to-point on a duplicate of the job's communicator, for fabrics where MPI
  is faster than TCP (RDMA). Fail-stop: Open MPI ends the job when a rank dies. Its waits
  sleep-poll (``Iprobe`` + a ``poll_s`` sleep: Open MPI's blocking probe spins a core).

A rank's end sends its commit without a copy (ZeroMQ in frames of at most 8 MiB straight
from the caller's buffer); the server's end copies each reply, so that a rank slow to read
holds up no other rank's commit. Both return from ``send`` once the buffer may be changed
again; a received message lands in the caller's preallocated MessageBuffer.
"""
from __future__ import annotations

import itertools
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from . import protocol
from .protocol import Header, Message, MessageBuffer

__all__ = ["PeerLost", "StalePeer", "JoinRequest", "join_identity", "rank_identity", "ServerLost",
           "LostPeerError", "ServerEnd", "RankEnd", "MPIServerEnd", "MPIRankEnd",
           "ZmqServerEnd", "ZmqRankEnd", "advertised_hosts", "pick_host", "open_ends"]


@dataclass(frozen=True)
class PeerLost:
    """The server's end saw rank `rank` go (its connection closed or fell silent)."""

    rank: int
    why: str


@dataclass(frozen=True)
class StalePeer:
    """A message from a process whose rank's slot now belongs to another connection (it was
    dropped as lost, and a replacement took the slot): answer it at `peer` that it is out."""

    peer: bytes
    rank: int


@dataclass(frozen=True)
class JoinRequest:
    """A replacement (not yet a rank) asks for a lost rank's slot; answer it at `peer`."""

    peer: bytes
    message: Message


def join_identity() -> bytes:
    """A replacement's identity until it has a slot: unique per process."""
    return b"ashl-join-%d-%s" % (os.getpid(), os.urandom(4).hex().encode())


def rank_identity(rank: int) -> bytes:
    """A rank's identity: its rank and a nonce, so that a dropped process and the
    replacement in its slot are never taken for one another."""
    return b"ashl-rank-%d-%s" % (rank, os.urandom(6).hex().encode())


class ServerLost(RuntimeError):
    """A rank's end lost the parameter server."""


class LostPeerError(RuntimeError):
    """A fail-stop run's server end lost a rank: the run cannot go on without it."""


class ServerEnd:
    """The server's end of the commit transport."""

    fault_tolerant = False

    def poll(self, timeout_s: float) -> Union[Message, PeerLost, JoinRequest, StalePeer, None]:
        """The next commit, a lost peer, a replacement's JOIN or a stale peer's message, or None
        after `timeout_s` of nothing; a malformed message raises protocol.ProtocolError (it is
        consumed, the stream stays in step)."""
        raise NotImplementedError

    def assign(self, rank: int, identity: bytes) -> None:
        """From now on rank `rank` is the connection that calls itself `identity`."""
        raise NotImplementedError(f"{type(self).__name__} has no replacements")

    def send(self, dest: int, header: Header, payload=None, until_written: bool = False) -> bool:
        """Send one message to rank `dest`; False if that rank is gone. The caller may change
        the payload once this returns. `until_written`: return only once the message is on
        its way (a final message: the end may close after it)."""
        raise NotImplementedError

    def drain(self) -> None:
        """Return once no message sent needs this thread any more (the server's last
        replies, before its thread ends): over MPI, once each send has completed (a large
        one: its rank has received it); ZeroMQ's own I/O thread writes out what it was
        given."""

    def close(self) -> None:
        pass


class RankEnd:
    """A rank's end of the commit transport."""

    # send waits for the transfer (MPI_Send of a large message): an overlapped commit is
    # sent from a thread, so that its upload overlaps the rank's steps as over ZeroMQ
    send_blocks = False
    # poll(timeout) waits inside the transport without waking Python (ZeroMQ's poller): a
    # thread may watch for an overlapped commit's reply at no cost to the rank's steps
    poll_waits_idle = False

    def send(self, header: Header, payload=None,
             cancelled: Optional[threading.Event] = None) -> bool:
        """Send a message to the server; False if `cancelled` was set before it could leave
        (an overlapped commit's uploader, when the rank closes its client)."""
        raise NotImplementedError

    def recv(self, buffer: MessageBuffer) -> Message:
        """The server's next message (a reply, a plan, the run's end); raises ServerLost."""
        raise NotImplementedError

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Is the server's next message here (``recv`` would not wait)? Waits at most
        `timeout_s` for it; raises ServerLost as ``recv`` does. An overlapped commit checks
        its reply with it between local steps."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _check_server(self) -> None:
        """ServerLost once `server_error()` (the server thread of this rank, if it is the
        server rank) says it has died."""
        error = self.server_error()
        if error is not None:
            raise ServerLost("the parameter server failed") from error


# --------------------------------------------------------------------------- MPI

class MPIServerEnd(ServerEnd):
    """Commits on ``protocol.TAG_TO_SERVER`` from any rank, replies on ``TAG_TO_RANK``.

    A reply is a copy sent with MPI_Isend. A blocking MPI_Send of a large message returns
    only once the rank has posted its receive, which an overlapped rank does between its
    steps: the server thread would merge no other rank's commit meanwhile. MPI keeps the
    messages to one rank in order, and a rank has one commit in flight, so at most its reply
    and a plan are outstanding per rank; the copies of completed sends are reused (one
    allocation, and on RDMA one registration, per buffer rather than per reply). Open MPI
    moves a large send on only while its process calls MPI: the server thread polls this
    end between commits, and `drain`s it before it ends (the training thread may next wait
    in a collective that is not MPI's)."""

    def __init__(self, comm, model_numel: int, *, poll_s: float = 2e-4):
        self.comm, self.model_numel, self.poll_s = comm, model_numel, poll_s
        self.buffer = MessageBuffer(protocol.max_payload_nbytes(model_numel))
        self.outstanding: list = []    # (request, message): the copies MPI may still read
        self.spare: list = []          # copies whose send completed, for the next replies
        self.max_spare = comm.Get_size()

    def poll(self, timeout_s: float):
        from mpi4py import MPI
        deadline = time.monotonic() + timeout_s
        self._drop_sent()
        while not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=protocol.TAG_TO_SERVER):
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_s)   # Open MPI's blocking probe would spin a core
        return protocol.recv(self.comm, self.buffer, tag=protocol.TAG_TO_SERVER,
                             model_numel=self.model_numel)

    def send(self, dest: int, header: Header, payload=None, until_written: bool = False) -> bool:
        """`until_written`: return once its send (and every one before it) has completed:
        a large message, once the rank has received it."""
        self._drop_sent()
        fit = next((i for i, m in enumerate(self.spare) if m.size == header.nbytes), None)
        message = protocol.packed(header, payload,
                                  out=None if fit is None else self.spare.pop(fit))
        request = protocol.isend(self.comm, dest, message, tag=protocol.TAG_TO_RANK)
        self.outstanding.append((request, message))
        if until_written:
            self.drain()
        return True

    def _drop_sent(self) -> None:
        still = []
        for request, message in self.outstanding:
            if not request.Test():
                still.append((request, message))
            elif message.size >= _SPARE_MIN_BYTES and len(self.spare) < self.max_spare:
                self.spare.append(message)
        self.outstanding = still

    def drain(self) -> None:
        """Until every send has completed, as each blocking send used to wait."""
        self._drop_sent()
        while self.outstanding:
            time.sleep(self.poll_s)
            self._drop_sent()

    def close(self) -> None:
        """A copy whose send has not completed (the server thread failed before its rank
        read it) is kept for the process's lifetime, since MPI may yet read it."""
        self._drop_sent()
        for request, message in self.outstanding:
            protocol.keep_pending(request, message)
        self.outstanding, self.spare = [], []


_SPARE_MIN_BYTES = 1 << 16   # smaller copies (a plan, a stop) cost nothing to allocate


class MPIRankEnd(RankEnd):
    """Commits to `server_rank`; waits for the answer without spinning a core, and gives up
    when `server_error()` says the server thread on this rank has died."""

    send_blocks = True

    def __init__(self, comm, server_rank: int, model_numel: int, *, poll_s: float = 2e-4,
                 server_error: Callable[[], Optional[BaseException]] = lambda: None):
        self.comm, self.server_rank, self.model_numel = comm, server_rank, model_numel
        self.poll_s, self.server_error = poll_s, server_error
        self.to_itself = comm.Get_rank() == server_rank

    def send(self, header: Header, payload=None,
             cancelled: Optional[threading.Event] = None) -> bool:
        """The commit, unless `cancelled` is set (False) or this rank's server thread has
        died (ServerLost).

        To another rank, a blocking MPI_Send: a sleep-polled MPI_Isend made a 4 MiB round
        trip 4x slower (Open MPI moves a large message on only while the process calls MPI),
        and a Python thread testing it without a pause would compete with the rank's steps
        for the GIL as long as the transfer lasts (not measured). To itself
        (the server rank's own commits), MPI_Isend polled: its receiver is this process's
        server thread, which may die before it receives, and a cancel while it waits gives
        it up (False)."""
        if cancelled is not None and cancelled.is_set():
            return False
        self._check_server()
        wait = (lambda request: self._wait(request, cancelled)) if self.to_itself else None
        return protocol.send(self.comm, self.server_rank, header, payload,
                             tag=protocol.TAG_TO_SERVER, wait=wait)

    def _wait(self, request, cancelled: Optional[threading.Event]) -> bool:
        """Test `request` every `poll_s` until it completes (True) or `cancelled` is set
        (False); ServerLost if this rank's server thread dies meanwhile."""
        while not request.Test():
            self._check_server()
            if cancelled is not None and cancelled.is_set():
                return False
            time.sleep(self.poll_s)
        return True

    def recv(self, buffer: MessageBuffer) -> Message:
        self.poll(math.inf)
        return protocol.recv(self.comm, buffer, source=self.server_rank,
                             tag=protocol.TAG_TO_RANK, model_numel=self.model_numel)

    def poll(self, timeout_s: float = 0.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.comm.Iprobe(source=self.server_rank, tag=protocol.TAG_TO_RANK):
            self._check_server()
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.poll_s)
        return True


# ------------------------------------------------------------------------ ZeroMQ

def _rank_of(identity: bytes) -> Optional[int]:
    """The rank a rank_identity names (None for any other identity)."""
    prefix = b"ashl-rank-"
    number = identity[len(prefix):].split(b"-", 1)[0]
    if identity.startswith(prefix) and number.isdigit():
        return int(number)
    return None


def _heartbeats(sock, heartbeat_s: float, timeout_s: float) -> None:
    import zmq
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.SNDHWM, 0)   # never drop a reply or a commit
    sock.setsockopt(zmq.RCVHWM, 0)
    # data unacknowledged this long (a host cut off) closes the connection at the TCP level
    sock.setsockopt(zmq.TCP_MAXRT, max(1, int(timeout_s * 1000)))


_CHUNK = 8 << 20   # payload frames: libzmq allocates each received frame, and an allocation
                   # above glibc's 32 MiB mmap ceiling is fresh pages (page faults) every time


def _recv_frames(sock, buffer: MessageBuffer) -> int:
    """One message's header frame and payload frames, into `buffer`; the byte count. A
    message that is not a protocol message (a header frame of another size, more payload
    than the buffer holds) is drained and refused."""
    import zmq
    head = sock.recv_into(buffer.array[:protocol.HEADER_SIZE])
    room, off, fits = buffer.array[protocol.HEADER_SIZE:], 0, head == protocol.HEADER_SIZE
    while sock.getsockopt(zmq.RCVMORE):
        if fits and off < len(room):
            n = sock.recv_into(room[off:])
            fits = off + n <= len(room)
        else:
            n, fits = len(sock.recv()), False
        off += n
    if not fits:
        raise protocol.ProtocolError("length", f"a message of a {head}-byte header frame and "
                                     f"{off} payload bytes does not fit a {protocol.HEADER_SIZE}"
                                     f"-byte header and a {len(room)}-byte payload buffer")
    return head + off


def _send_parts(sock, prefix: list, header: Header, payload, copy: bool,
                wait: Optional[float] = None) -> bool:
    """Header frame, then the payload in frames of at most _CHUNK bytes.

    `copy`: the payload is copied into ZeroMQ's messages now, and the caller may change it
    at once, as after MPI_Send: the server, whose replies carry the global model it keeps
    merging into. Without a copy ZeroMQ holds the caller's memory until the message is
    written out: a rank, which reuses its send buffer only after the reply (which the server
    sends once it has the whole commit), and whose commit may sit queued for a server that
    is gone (a DEALER queues for ever), so nothing waits for it. `wait` (seconds, without a
    copy): return once ZeroMQ has written the payload out, False if that took longer."""
    import zmq
    head = protocol.encode(header)
    want = header.payload_nbytes
    if want == 0:
        sock.send_multipart(prefix + [head])
        return True
    if payload is None:
        raise ValueError(f"{protocol.Kind(header.kind).name} needs a {want}-byte payload")
    body = protocol._as_bytes(payload)
    if body.size != want:
        raise ValueError(f"payload has {body.size} bytes but the header says {want}")
    chunks = [body[i:i + _CHUNK] for i in range(0, want, _CHUNK)]
    for part in prefix + [head]:
        sock.send(part, zmq.SNDMORE)
    track = wait is not None and not copy
    trackers = [sock.send(chunk, 0 if i == len(chunks) - 1 else zmq.SNDMORE, copy=copy,
                          track=track) for i, chunk in enumerate(chunks)]
    deadline = time.monotonic() + (wait or 0.0)
    for tracker in trackers if track else ():
        try:
            tracker.wait(max(1e-3, deadline - time.monotonic()))
        except zmq.NotDone:
            return False
    return True


class _SharedContext:
    """A zmq.Context for the ends of one process (``inproc://`` connects only within one
    context), terminated when the last of them closes: neither end's close waits for the
    other's (the server thread closes its end when it fails, while the training thread may
    still hold its own)."""

    def __init__(self):
        import zmq
        # Zero-copy sends need pyzmq's garbage collector, which stops at interpreter exit.
        # Imported now, its exit hook is registered before ashl's (torch/exit.py, which
        # sends the last commits at exit), so it runs after it.
        import zmq.utils.garbage  # noqa: F401
        self.context = zmq.Context(io_threads=1)
        self.users, self.lock = 1, threading.Lock()

    def share(self) -> "_SharedContext":
        with self.lock:
            self.users += 1
        return self

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.context.term()


_INPROC = itertools.count()


class ZmqServerEnd(ServerEnd):
    """A ROUTER bound on every interface at a free port (``port``), and at ``inproc`` for
    the server rank's own end (``own_end``); peers are told apart by their identity, which
    names their rank. Fail-stop (``fault_tolerant=False``): a lost peer raises
    LostPeerError instead of being reported."""

    def __init__(self, world_size: int, model_numel: int, *, heartbeat_s: float = 0.5,
                 timeout_s: float = 5.0, port: int = 0, fault_tolerant: bool = True):
        import zmq
        self.world_size, self.model_numel, self.timeout_s = world_size, model_numel, timeout_s
        self.heartbeat_s, self.fault_tolerant = heartbeat_s, fault_tolerant
        self.shared = _SharedContext()
        self.context = self.shared.context
        self.sock = self.context.socket(zmq.ROUTER)
        _heartbeats(self.sock, heartbeat_s, timeout_s)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a reply to a gone peer fails, not vanishes
        self.sock.copy_threshold = 0                     # every zero-copy frame tracked (send)
        # (ROUTER_NOTIFY would name the peer, but is a draft option the wheels do not build)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.owner: dict[int, bytes] = {}          # rank -> the identity that is that rank
        self.fd_identity: dict[int, bytes] = {}    # connection -> who speaks through it
        self.lost: list[PeerLost] = []             # disconnects seen, not yet returned
        self.own_identity: Optional[bytes] = None  # the server rank's own end (own_end)
        if port:
            self.sock.bind(f"tcp://*:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port("tcp://*")
        self.inproc = f"inproc://ashl-server-{os.getpid()}-{next(_INPROC)}"
        self.sock.bind(self.inproc)
        self.buffer = MessageBuffer(protocol.max_payload_nbytes(model_numel))

    def own_end(self, rank: int, *, server_error: Callable[[], Optional[BaseException]]
                = lambda: None) -> "ZmqRankEnd":
        """The server rank's own end: a DEALER in this process, over inproc (no TCP, no
        copy on the way in but the one into the server's buffer; replies to it are copied
        out, see send)."""
        assert self.own_identity is None, "one own end per server end"
        self.own_identity = rank_identity(rank)
        return ZmqRankEnd(self.inproc, rank, self.model_numel, world_size=self.world_size,
                          server_rank=rank, heartbeat_s=self.heartbeat_s,
                          timeout_s=self.timeout_s, identity=self.own_identity,
                          server_error=server_error, context=self.shared.share())

    def poll(self, timeout_s: float):
        import zmq
        # rounded up (as ZmqRankEnd.poll): rounded down, the server thread's loop spent the
        # last fraction of a millisecond before each tick in poll(0) calls
        ready = dict(self.poller.poll(math.ceil(max(0.0, timeout_s) * 1000)))
        if self.monitor in ready:
            self._disconnects()
        if self.lost:
            lost = self.lost.pop(0)
            if not self.fault_tolerant:
                raise LostPeerError(f"lost rank {lost.rank}: {lost.why}; the run is fail-stop "
                                    "(fault_tolerant=False), it ends here")
            return lost
        if self.sock not in ready:
            return None
        frame = self.sock.recv(copy=False)
        identity, rank = frame.bytes, _rank_of(frame.bytes)
        count = _recv_frames(self.sock, self.buffer)
        if identity.startswith(b"ashl-join-"):
            message = protocol.received(self.buffer, count, 0, world_size=self.world_size,
                                        model_numel=self.model_numel, check_source=False)
            if message.header.kind != protocol.Kind.JOIN:
                raise protocol.ProtocolError("kind", "a replacement may only ask to JOIN")
            return JoinRequest(identity, message)
        if rank is None or not 0 <= rank < self.world_size:
            raise protocol.ProtocolError("rank", f"a message from unknown peer {identity[:32]!r}")
        if self.owner.setdefault(rank, identity) != identity:
            return StalePeer(identity, rank)
        try:
            self.fd_identity[frame.get(zmq.SRCFD)] = identity
        except zmq.ZMQError:   # inproc: no descriptor, and no connection to lose
            pass
        message = protocol.received(self.buffer, count, rank, world_size=self.world_size,
                                    model_numel=self.model_numel)
        return None if message.header.kind == protocol.Kind.HELLO else message

    def _disconnects(self) -> None:
        """Every disconnect the monitor has queued; those of a rank's own connection are
        PeerLost (a stale or a replacement's join connection is nobody's loss)."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            identity = self.fd_identity.pop(event["value"], None)
            rank = None if identity is None else _rank_of(identity)
            if event["event"] == zmq.EVENT_DISCONNECTED and rank is not None \
                    and self.owner.get(rank) == identity:
                self.lost.append(PeerLost(rank, "its connection closed (the process died, or "
                                                "was silent past the heartbeat timeout)"))

    def assign(self, rank: int, identity: bytes) -> None:
        self.owner[rank] = identity

    def send(self, dest: "int | bytes", header: Header, payload=None,
             until_written: bool = False) -> bool:
        """To rank `dest`, or to a peer's identity (bytes); False if it is gone or never
        connected. The payload is copied (4 MB in about a millisecond): held by ZeroMQ
        until written out, the global model could take no merge meanwhile, and over a slow
        link every other rank's commit waited behind the slowest rank's download; over
        inproc, until the server rank read it, after its current step. A rank has one
        commit in flight, so the copies queued are at most one model per rank.
        `until_written`: not copied, and the send returns once it is written out (False
        after timeout_s): the final model, which no longer changes, before the end closes
        (its linger alone would give every rank's download one window)."""
        import zmq
        peer = dest if isinstance(dest, bytes) else self.owner.get(dest)
        if peer is None:
            return False
        try:
            return _send_parts(self.sock, [peer], header, payload, copy=not until_written,
                               wait=self.timeout_s if until_written else None)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def close(self) -> None:
        # Linger: the final messages may still be queued; a gone peer cannot hold it longer.
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=int(self.timeout_s * 1000))
        self.shared.release()


class ZmqRankEnd(RankEnd):
    """A DEALER connected to the server's ROUTER at `endpoint`, with identity `rank`."""

    poll_waits_idle = True
    DRAIN_S = 0.5     # after the server's disconnect: messages it sent before may still land

    def __init__(self, endpoint: str, rank: int, model_numel: int, *, world_size: int,
                 server_rank: Optional[int], heartbeat_s: float = 0.5, timeout_s: float = 5.0,
                 identity: Optional[bytes] = None,
                 server_error: Callable[[], Optional[BaseException]] = lambda: None,
                 context: Optional[_SharedContext] = None):
        """`server_rank` None: not known yet (a replacement), any sender rank is taken.
        `server_error`: the server thread of this process, if it failed. `context`: the
        server end's, for its inproc endpoint (ZmqServerEnd.own_end)."""
        import zmq
        self.endpoint, self.model_numel = endpoint, model_numel
        self.world_size, self.server_rank = world_size, server_rank
        self.timeout_s, self.server_error = timeout_s, server_error
        identity = identity or rank_identity(rank)
        self.shared = context or _SharedContext()
        self.sock = self.shared.context.socket(zmq.DEALER)
        _heartbeats(self.sock, heartbeat_s, timeout_s)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        # a DEALER with no peer at all blocks in send (inproc, once the server's end closed):
        # give up every 0.25 s to look at the server thread (send)
        self.sock.setsockopt(zmq.SNDTIMEO, 250)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        # an inproc connection is made at once, and has no events
        self.connected = endpoint.startswith("inproc://")
        self.lost_at: Optional[float] = None   # time.monotonic of the server's disconnect
        self.sock.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        if _rank_of(identity) is not None:
            # at once: the server knows this connection is this rank before its first commit
            self.send(Header(kind=protocol.Kind.HELLO, rank=rank))

    def send(self, header: Header, payload=None,
             cancelled: Optional[threading.Event] = None) -> bool:
        """Raises ServerLost when the server has been unreachable for timeout_s (an
        overlapped commit's uploader must end, so that the end can close); gives up, False,
        within SNDTIMEO once `cancelled` is set (the client closing: not after timeout_s)."""
        import zmq
        started = time.monotonic()
        while True:
            try:
                return _send_parts(self.sock, [], header, payload, copy=False)
            except zmq.Again:   # nothing went: no peer to queue for (the first frame blocks)
                if cancelled is not None and cancelled.is_set():
                    return False
                self._check_server()
                if time.monotonic() - started > self.timeout_s:
                    raise ServerLost(f"could not send to the parameter server "
                                     f"({self._where()}) for {self.timeout_s:g} s: it is "
                                     "not connected") from None

    def recv(self, buffer: MessageBuffer) -> Message:
        started = time.monotonic()
        while True:
            ready = dict(self.poller.poll(50 if self.lost_at else 250))
            if self.sock in ready:   # what arrived before a disconnect is still the server's
                count = _recv_frames(self.sock, buffer)
                return protocol.received(buffer, count, self.server_rank or 0,
                                         world_size=self.world_size, model_numel=self.model_numel,
                                         check_source=self.server_rank is not None)
            if self.monitor in ready:
                self._take_event()
            self._check_lost()
            if not self.connected and time.monotonic() - started > self.timeout_s:
                raise ServerLost(f"could not reach the parameter server ({self._where()}) in "
                                 f"{self.timeout_s:g} s")

    def poll(self, timeout_s: float = 0.0) -> bool:
        """As recv's wait, in slices (an overlapped commit's reply, between local steps)."""
        deadline = time.monotonic() + timeout_s
        while True:
            # whole milliseconds, rounded up: rounded down, the last fraction of one was
            # spent in poll(0) calls, a spin (an overlapped commit's watcher polls in slices)
            left_ms = math.ceil(max(0.0, deadline - time.monotonic()) * 1000)
            ready = dict(self.poller.poll(left_ms))
            if self.sock in ready:
                return True
            if self.monitor in ready:
                self._take_event()
            self._check_lost()
            if time.monotonic() >= deadline:
                return False

    def _take_event(self) -> None:
        """One event of the connection's monitor. A disconnect is remembered in lost_at, by
        whichever of poll and recv read it, until a reconnect (a passing drop): a disconnect
        that poll read must still end the recv that follows it."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message
        event = recv_monitor_message(self.monitor)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self.lost_at = self.lost_at or time.monotonic()
        elif event == zmq.EVENT_CONNECTED:
            self.lost_at = None
            self.connected = True

    def _check_lost(self) -> None:
        """ServerLost if this process's server thread failed, or if the connection closed
        DRAIN_S ago (what it sent before its disconnect has landed by then)."""
        self._check_server()
        if self.lost_at is not None and time.monotonic() - self.lost_at > self.DRAIN_S:
            raise ServerLost(f"lost the parameter server ({self._where()}): its connection "
                             "closed")

    def _where(self) -> str:
        return (self.endpoint if self.server_rank is None
                else f"rank {self.server_rank}, {self.endpoint}")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.shared.release()


# ----------------------------------------------------------------- the endpoint

def advertised_hosts() -> list[str]:
    """The server host's IPv4 addresses a rank may connect to, loopback last."""
    import psutil
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and a.address not in found:
                found.append(a.address)
    return sorted(found, key=lambda a: a.startswith("127.")) or ["127.0.0.1"]


def host_identity() -> str:
    """Who shares this process's loopback: the same kernel (its boot id) and the same network
    namespace (an emulated host, a container). Equal addresses prove nothing: every host with
    Docker has 172.17.0.1."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return f"{socket.gethostname()}:{os.getpid()}"   # unknown: never taken for the same


def pick_host(server_hosts: list[str], server_identity: Optional[str] = None) -> str:
    """Which of the server's addresses this rank connects to: loopback when the server
    shares this host's loopback (`server_identity` == host_identity()), else one on a subnet
    of this host's own interfaces, else the first. ASHL_SERVER_HOST overrides (a cluster
    whose routing this cannot guess)."""
    if os.environ.get("ASHL_SERVER_HOST"):
        return os.environ["ASHL_SERVER_HOST"]
    import ipaddress
    import psutil
    if server_identity == host_identity() or not any(
            not h.startswith("127.") for h in server_hosts):
        return "127.0.0.1"
    own = [a for addrs in psutil.net_if_addrs().values() for a in addrs
           if a.family == socket.AF_INET and not a.address.startswith("127.")]
    # an address this host has too (docker0's 172.17.0.1 on every host) leads back here
    server_hosts = [h for h in server_hosts if h not in {a.address for a in own}] or server_hosts
    nets = [ipaddress.ip_interface(f"{a.address}/{a.netmask}").network for a in own if a.netmask]
    for host in server_hosts:
        if any(ipaddress.ip_address(host) in net for net in nets):
            return host
    return server_hosts[0]


def open_ends(comm, server_rank: int, model_numel: int, *, transport: str = "zmq",
              fault_tolerant: bool = False, timeout_s: float = 5.0, heartbeat_s: float = 0.5,
              poll_s: float = 2e-4,
              server_error: Callable[[], Optional[BaseException]] = lambda: None,
              join: Optional[str] = None):
    """(server end on `server_rank` else None, this rank's end), over `comm` (a duplicate
    of the job's communicator). Collective over zmq: the server rank binds its ROUTER and
    broadcasts where it listens; every other rank connects to it over TCP, the server rank
    over inproc. A replacement (`join`: the run's endpoint, ASHL_JOIN) connects there
    alone, under a join identity. A fault-tolerant run needs zmq (ValueError)."""
    if join is not None:
        return None, ZmqRankEnd(join, 0, model_numel, world_size=2**31 - 1, server_rank=None,
                                heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                                identity=join_identity())
    if transport not in ("zmq", "mpi") or (fault_tolerant and transport != "zmq"):
        raise ValueError(f"transport {transport!r} (fault_tolerant={fault_tolerant}): expected "
                         "'zmq', or 'mpi' for a fail-stop run")
    rank, size = comm.Get_rank(), comm.Get_size()
    if transport == "mpi":
        server = MPIServerEnd(comm, model_numel, poll_s=poll_s) if rank == server_rank else None
        return server, MPIRankEnd(comm, server_rank, model_numel, poll_s=poll_s,
                                  server_error=server_error)
    server = None
    where = None
    if rank == server_rank:
        server = ZmqServerEnd(size, model_numel, heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                              port=int(os.environ.get("ASHL_SERVER_PORT", "0")),
                              fault_tolerant=fault_tolerant)
        where = {"hosts": advertised_hosts(), "port": server.port, "host": host_identity()}
    where = comm.bcast(where, root=server_rank)
    if server is not None:
        return server, server.own_end(rank, server_error=server_error)
    host = pick_host(where["hosts"], where["host"])
    end = ZmqRankEnd(f"tcp://{host}:{where['port']}", rank, model_numel, world_size=size,
                     server_rank=server_rank, heartbeat_s=heartbeat_s, timeout_s=timeout_s,
                     server_error=server_error)
    return server, end
