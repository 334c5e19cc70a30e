"""The rank's half of the commit protocol: ``ServerClient.commit(payload, commit) -> Reply``.

The server's half is ``server.ServerThread``. A commit is one message (header + the
compressed delta) through a transport.RankEnd (ZeroMQ, in-process on the server rank, or
MPI point-to-point: ``transport=``); the answer is one REPLY carrying the global model, followed by a PLAN
message when the rank's plan is out of date. The client fills the header, emulates a slow
link if asked, waits for the answer, and returns it decoded: accepted or rejected,
the stage the run is in, a stop, a new plan. What a rank does with the answer is the
strategy's business.

An overlapped commit (``begin``, then ``reply(wait=False)`` between local steps until it
returns the Reply) is the same exchange in slices, at most one in flight: an emulated link's
commit leaves at its departure time and its reply is taken only from its arrival time, as
the blocking ``commit`` (which is ``begin`` then ``reply(wait=True)``) sleeps for them.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import protocol
from .compression import Payload
from .emulation import Heterogeneity, sleep_until
from .planner import Plan
from .protocol import Flag, Header, Kind
from .stages import Stage
from .transport import RankEnd

__all__ = ["Commit", "Reply", "ServerClient"]

WATCH_SLICE_S = 0.05    # how soon a reply's watcher sees that the commit was cancelled


@dataclass(frozen=True)
class Commit:
    """What a rank tells the server about the delta it sends."""

    stage: Stage
    number: int             # this rank's commit count before this one
    base_version: int       # the global version the delta was computed against
    plan_version: int
    epoch: int
    local_steps: int        # local steps in the delta
    step_s: Optional[float] = None   # mean compute seconds per step of the round
    loss: Optional[float] = None     # the rank's running training loss
    final: bool = False              # the rank's last commit


@dataclass(frozen=True)
class Reply:
    """The server's answer to one commit."""

    accepted: bool                  # the delta was merged
    stop: bool                      # the run is over for this rank
    stage: Stage                    # the run's stage now
    version: int                    # the global model's version in `model`
    model: Optional[torch.Tensor]   # the global model (a view of the client's buffer, valid
                                    # until the next commit), None if the reply carries none
    plan: Optional[Plan]            # a newer plan, if the rank's was out of date
    bytes_sent: int                 # the commit message's size
    dropped: bool = False           # the server had dropped this rank as lost
    commit_rate: int = 0            # adsp: the scheduler's commits per check period (0: none)
    shares_epoch: int = 0           # the data shares of `stage` (and the plan) apply from it


@dataclass
class InFlight:
    """A commit on its way: sent once its emulated departure time has come, answered once
    its reply has been received and its emulated arrival time has come."""

    header: Header
    payload: Payload
    t_send: float                  # perf_counter at begin: the link time counts from here
    depart_at: float               # time.monotonic: when it leaves (emulated upload)
    sent: bool = False
    uploader: Optional[threading.Thread] = None     # sends it at depart_at, beside the steps
                                                    # (over a real link: and watches for
                                                    # its reply, to stamp link_end)
    cancelled: threading.Event = field(default_factory=threading.Event)   # by close()
    upload_error: Optional[BaseException] = None    # what the uploader's send raised
    answer: Optional[protocol.Message] = None
    arrive_at: float = 0.0         # time.monotonic: when its reply may be taken
    link_end: float = 0.0          # perf_counter: when the reply was there to take (0: not
                                   # known yet)


class ServerClient:
    """Commits to the parameter server through a transport.RankEnd (ZeroMQ or MPI)."""

    def __init__(self, end: RankEnd, rank: int, numel: int, *,
                 heterogeneity: Optional[Heterogeneity] = None, pinned: bool = False):
        """`pinned`: the reply's model lands in page-locked memory (a GPU model's)."""
        self.end, self.rank, self.numel = end, rank, numel
        self.hetero = heterogeneity or Heterogeneity()
        self.model_buf = protocol.MessageBuffer(4 * numel, pinned=pinned)
        self.plan_buf = protocol.MessageBuffer(protocol.MAX_PLAN_BYTES)
        # The previous exchange, reported with the next commit (drift detection).
        self.last_link_s: Optional[float] = None
        self.last_ratio = 1.0
        self.inflight: Optional[InFlight] = None
        # A real link's reply is seen between the rank's steps, up to a step after it
        # landed: a transport that can wait without cost has a thread stamp its arrival, so
        # the link time the drift detector is told is the link's, not the step's
        self.watch_replies = self.hetero.link is None and end.poll_waits_idle

    def commit(self, payload: Payload, commit: Commit) -> Reply:
        """Send a commit and wait for its answer."""
        self.begin(payload, commit, overlapped=False)
        return self.reply(wait=True)

    def begin(self, payload: Payload, commit: Commit, overlapped: bool = True) -> int:
        """Start a commit; its message size. The payload's buffer must stay as it is until
        its reply. An `overlapped` commit leaves beside the rank's steps, as a real link's
        upload runs beside the compute: now, or over an emulated link (or a transport whose
        send blocks) from an uploader thread at its departure time (until 2026-12-06 it left
        at the first step boundary after that, up to a step late), and over a real link
        whose transport can wait idle, from a thread that then watches for its reply. A
        blocking commit leaves in ``reply``."""
        if self.inflight is not None:
            raise RuntimeError("a commit is already in flight: take its reply first")
        header = self._header(payload, commit)
        f = InFlight(header, payload, time.perf_counter(),
                     time.monotonic() + self.hetero.link_delay(header.nbytes))
        self.inflight = f
        if overlapped and (f.depart_at > time.monotonic() or self.end.send_blocks
                           or self.watch_replies):
            f.uploader = threading.Thread(target=self._upload, args=(f,), name="ashl-upload",
                                          daemon=True)
            f.uploader.start()
        elif overlapped:
            self._send(f)
        return header.nbytes

    def _send(self, f: InFlight) -> None:
        sleep_until(f.depart_at)
        f.sent = self.end.send(f.header, f.payload.buffer, cancelled=f.cancelled)

    def _upload(self, f: InFlight) -> None:
        """The uploader: `f` leaves at its departure time unless cancelled first, and with
        `watch_replies` the thread stays until its reply has landed (stamped in link_end).
        Until this returns only this thread uses the end (the training thread waits for it
        before it polls for the reply)."""
        try:
            if not f.cancelled.wait(max(0.0, f.depart_at - time.monotonic())):
                self._send(f)
                while f.sent and self.watch_replies and not f.cancelled.is_set():
                    if self.end.poll(WATCH_SLICE_S):
                        f.link_end = time.perf_counter()
                        return
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread's reply()
            f.upload_error = exc

    def _departed(self, f: InFlight, wait: bool) -> bool:
        """Has `f` left (`wait`: once it has; a blocking commit leaves here)? What the
        uploader's send raised is raised here."""
        if f.uploader is not None:
            if not wait and f.uploader.is_alive():
                return False
            f.uploader.join()
            if f.upload_error is not None:
                raise f.upload_error
            return True
        if not f.sent:
            if not wait and time.monotonic() < f.depart_at:
                return False
            self._send(f)
        return True

    def close(self) -> None:
        """Forget the commit in flight: one still waiting for its departure (a dropped
        rank's, the run over) never leaves, and the end may close after this."""
        f, self.inflight = self.inflight, None
        if f is not None and f.uploader is not None:
            f.cancelled.set()
            f.uploader.join()

    def reply(self, wait: bool) -> Optional[Reply]:
        """The in-flight commit's answer; without `wait`, None while it has not arrived (the
        commit may leave in this call)."""
        f = self.inflight
        if f is None:
            raise RuntimeError("no commit in flight")
        if not self._departed(f, wait):
            return None
        if f.answer is None:
            if not wait and not self.end.poll(0.0):
                return None
            f.answer = self._receive(self.model_buf, Kind.REPLY)
            h = f.answer.header
            f.arrive_at = self.hetero.arrival(h.sent_at, h.nbytes)
            # an emulated link's reply was there at its arrival time, though the rank may
            # look only later, between its steps; a real one's when the uploader saw it land
            # (watch_replies), else when it is seen here
            ahead = f.arrive_at - time.monotonic() if self.hetero.link is not None else 0.0
            f.link_end = f.link_end or time.perf_counter() + ahead
        if not wait and time.monotonic() < f.arrive_at:
            return None
        sleep_until(f.arrive_at)
        self.inflight = None
        return self._decode(f)

    def _decode(self, f: InFlight) -> Reply:
        """The Reply to `f`, with the plan that follows it."""
        payload, answer, header = f.payload, f.answer, f.header
        self.last_link_s = max(0.0, f.link_end - f.t_send)   # clocks of two hosts may differ
        self.last_ratio = payload.nnz / payload.numel if payload.sparse and payload.numel else 1.0
        h = answer.header
        plan = None
        if h.flags & Flag.PLAN_FOLLOWS:
            plan = Plan.from_dict(self._receive(self.plan_buf, Kind.PLAN).json())
        return Reply(accepted=bool(h.flags & Flag.ACCEPTED), stop=bool(h.flags & Flag.STOP),
                     stage=h.stage, version=h.base_version,
                     model=answer.dense() if h.numel else None, plan=plan,
                     bytes_sent=header.nbytes, dropped=bool(h.flags & Flag.DROPPED),
                     commit_rate=h.local_steps, shares_epoch=h.epoch)

    def join(self, request: dict) -> tuple[dict, Optional[Reply]]:
        """A replacement asks for a lost rank's slot (`request`: its compute time per step,
        host, model size). The answer: {"rank", "size", "server_rank"} and the global model
        and plan as a Reply, or {"error": why} and None."""
        body = protocol.json_payload(request)
        self.end.send(Header(kind=Kind.JOIN, rank=0, dtype=protocol.DType.UINT8,
                             numel=body.size), body)
        answer = self._receive(self.plan_buf, Kind.SUMMARY).json()
        if "error" in answer:
            return answer, None
        model = self._receive(self.model_buf, Kind.REPLY)
        h = model.header
        plan = Plan.from_dict(self._receive(self.plan_buf, Kind.PLAN).json())
        return answer, Reply(accepted=False, stop=bool(h.flags & Flag.STOP), stage=h.stage,
                             version=h.base_version, model=model.dense(), plan=plan,
                             bytes_sent=protocol.HEADER_SIZE + body.size)

    def final(self) -> tuple[torch.Tensor, dict]:
        """Fault-tolerant end: the run's final global model (a view of the client's buffer)
        and its summary (why it ended, which ranks were lost), sent to every rank that left."""
        model = self._receive(self.model_buf, Kind.REPLY).dense()
        return model, self._receive(self.plan_buf, Kind.SUMMARY).json()

    def _header(self, payload: Payload, c: Commit) -> Header:
        return Header(rank=self.rank, stage=c.stage, commit=c.number, base_version=c.base_version,
                      plan_version=c.plan_version, epoch=c.epoch, local_steps=c.local_steps,
                      flags=Flag.FINAL if c.final else Flag(0), samples=c.local_steps,
                      step_s=Header.optional(c.step_s), link_s=Header.optional(self.last_link_s),
                      link_ratio=self.last_ratio, loss=Header.optional(c.loss),
                      **payload.header_fields())

    def _receive(self, buffer: protocol.MessageBuffer, kind: Kind) -> protocol.Message:
        message = self.end.recv(buffer)
        if message.header.kind != kind:
            raise protocol.ProtocolError("kind", f"expected {kind.name} from the server, got "
                                         f"{Kind(message.header.kind).name}")
        return message
