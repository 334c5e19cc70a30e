"""The rank's half of the commit protocol: ``ServerClient.commit(payload, commit) -> Reply``.

The server's half is ``server.ServerThread``. A commit is one message (header + the
compressed delta) on ``protocol.TAG_TO_SERVER``; the answer is one REPLY on
``protocol.TAG_TO_RANK`` carrying the global model, followed by a PLAN message when the
rank's plan is out of date. The client fills the header, emulates a slow link if asked,
waits for the answer without spinning a core, and returns it decoded: accepted or rejected,
the stage the run is in, a stop, a new plan. What a rank does with the answer is the
strategy's business.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import protocol
from .compression import Payload
from .emulation import Heterogeneity
from .planner import Plan
from .protocol import Flag, Header
from .stages import Stage

__all__ = ["Commit", "Reply", "ServerClient"]


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


class ServerClient:
    """Commits to the parameter server on `server_rank` over `comm` (MPI point-to-point)."""

    def __init__(self, comm, server_rank: int, rank: int, numel: int, *,
                 heterogeneity: Optional[Heterogeneity] = None, poll_s: float = 2e-4,
                 server_error: Callable[[], Optional[BaseException]] = lambda: None):
        self.comm, self.server_rank, self.rank, self.numel = comm, server_rank, rank, numel
        self.hetero = heterogeneity or Heterogeneity()
        self.poll_s = poll_s
        self.server_error = server_error   # the host rank's server thread, if it failed
        self.model_buf = protocol.MessageBuffer(4 * numel)
        self.plan_buf = protocol.MessageBuffer(protocol.MAX_PLAN_BYTES)
        # The previous exchange, reported with the next commit (drift detection).
        self.last_link_s: Optional[float] = None
        self.last_ratio = 1.0

    def commit(self, payload: Payload, commit: Commit) -> Reply:
        header = self._header(payload, commit)
        t_send = time.perf_counter()
        self.hetero.depart(header.nbytes)
        protocol.send(self.comm, self.server_rank, header, payload.buffer,
                      tag=protocol.TAG_TO_SERVER)
        answer = self._receive(self.model_buf)
        self.hetero.arrive(answer.header.sent_at, answer.header.nbytes)
        self.last_link_s = time.perf_counter() - t_send
        self.last_ratio = payload.nnz / payload.numel if payload.sparse and payload.numel else 1.0
        h = answer.header
        plan = None
        if h.flags & Flag.PLAN_FOLLOWS:
            plan = Plan.from_dict(self._receive(self.plan_buf).json())
        return Reply(accepted=bool(h.flags & Flag.ACCEPTED), stop=bool(h.flags & Flag.STOP),
                     stage=h.stage, version=h.base_version,
                     model=answer.dense() if h.numel else None, plan=plan,
                     bytes_sent=header.nbytes)

    def _header(self, payload: Payload, c: Commit) -> Header:
        return Header(rank=self.rank, stage=c.stage, commit=c.number, base_version=c.base_version,
                      plan_version=c.plan_version, epoch=c.epoch, local_steps=c.local_steps,
                      flags=Flag.FINAL if c.final else Flag(0), samples=c.local_steps,
                      step_s=Header.optional(c.step_s), link_s=Header.optional(self.last_link_s),
                      link_ratio=self.last_ratio, loss=Header.optional(c.loss),
                      **payload.header_fields())

    def _receive(self, buffer: protocol.MessageBuffer) -> protocol.Message:
        """The next message from the server; polls, so a waiting rank leaves its core to the
        others, and gives up if the server thread on this rank has died."""
        while not self.comm.Iprobe(source=self.server_rank, tag=protocol.TAG_TO_RANK):
            error = self.server_error()
            if error is not None:
                raise RuntimeError("the parameter server failed") from error
            time.sleep(self.poll_s)
        return protocol.recv(self.comm, buffer, source=self.server_rank,
                             tag=protocol.TAG_TO_RANK, model_numel=self.numel)
