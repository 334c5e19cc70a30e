"""The parameter server: the global model's home on one rank, beside its training loop.

``ParameterServer`` is the merge rule, the staleness gate and the roll of live ranks, with no
I/O: it takes a decoded commit (or the news that a rank is gone) and says which replies go
out now. ``ServerThread`` is the edge: it takes commits from a transport.ServerEnd (ZeroMQ,
the host rank's own over inproc, or MPI; every rank commits through the same ServerEnd),
hands them to the server, sends the replies, and keeps its own CPU share and each commit's
latency at the server in ``ServerStats``. The rank's half of the exchange is
``client.ServerClient``.

Fault tolerance: a rank whose connection closes or falls silent (the transport says so), or
that, once its rounds have been seen, sends nothing for ``max(silence_s, silence_rounds x
its longest recent round)`` while not held back (a hung process), is dropped: it leaves the
live set, the coordinator re-plans among the survivors, and the record names it, when and
what it had contributed. What it had merged stays merged.

Merge: ``u = merge_weight[rank] * staleness(excess) * delta``, excess = the versions since the
delta's base beyond one commit of every other live rank and, for an overlapped commit (its
steps began before its previous reply arrived), beyond the versions that reply brought
(``ParameterServer.excess``), and the
outer optimizer applies u to the global model (outer.py: ``global += u`` by default, or an
outer Nesterov / Delayed Nesterov step) with the fused kernels (dense or bounds-checked
sparse), all or nothing: a delta holding NaN/Inf is rejected and counted, and the sender is
told so (it then resumes from the global model).
SHL: a rank more than ``bound`` commits ahead of the slowest live rank gets its reply only
once the slowest catches up (its delta is merged at once; only its next round waits). A stop
releases every waiting rank, so the wait can never deadlock.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import kernels, protocol
from .compression import Payload
from .coordinator import CommitReport, Coordinator, Directive, positive_seconds
from .outer import OuterOptimizer, make_outer
from .planner import Plan
from .protocol import Flag, Header, Kind
from .staleness import Staleness, parse_staleness
from .stages import Stage
from .staging import WireStaging
from .transport import JoinRequest, PeerLost, ServerEnd, StalePeer, rank_identity

log = logging.getLogger("ashl.server")

SHL_LOG_LENGTH = 10000
LATENCY_SAMPLES = 10000    # commit latencies kept for the median and p95: the latest ones


def busy_fraction(cpu_s: float, wall_s: float) -> Optional[float]:
    """The share of `wall_s` a thread spent on a CPU (`cpu_s` of its own CPU time), at most
    1 (the two clocks tick apart); None before any wall time has passed."""
    if wall_s <= 0:
        return None
    return min(1.0, max(0.0, cpu_s) / wall_s)


def nearest_rank(sorted_values, q: float) -> float:
    """The q-quantile (0 < q <= 1) of non-empty `sorted_values` by the nearest-rank rule:
    a value that was measured, never one between two."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def latency_summary(samples_ms, count: int) -> dict:
    """`count` commits seen; the median and p95 (ms) of `samples_ms`, the latest of them
    (None without any)."""
    ordered = sorted(samples_ms)
    return {"count": int(count), "samples": len(ordered),
            "median_ms": nearest_rank(ordered, 0.5) if ordered else None,
            "p95_ms": nearest_rank(ordered, 0.95) if ordered else None}


@dataclass
class ServerStats:
    merged: int = 0
    rejected_nonfinite: int = 0
    rejected_invalid: int = 0
    max_staleness: int = 0
    max_shl_lead: int = 0          # the furthest any SHL reply went ahead of the slowest rank
    waits: int = 0                 # SHL replies held back by the staleness bound
    bytes_received: int = 0
    # (rank, shl commit, slowest live) per SHL reply; the latest ones only, so a long run's
    # server memory stays flat
    shl_log: deque = field(default_factory=lambda: deque(maxlen=SHL_LOG_LENGTH))
    merged_by: list = field(default_factory=list)    # merged commits per rank
    lost: list = field(default_factory=list)         # LostRank, in the order they went
    # The server thread: its own CPU time and its wall time since it started, as of its
    # latest wake-up (busy fraction = cpu / wall: what it takes from the training beside it)
    thread_cpu_s: float = 0.0
    thread_wall_s: float = 0.0
    # Commit latency at the server: the commit received -> its reply sent (replies held
    # by the staleness bound are not counted: they wait for other ranks, not for the server)
    replies_timed: int = 0
    latency_ms: deque = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["shl_log"] = [list(x) for x in self.shl_log]
        d["lost"] = [dataclasses.asdict(x) for x in self.lost]
        d["merged_by"] = list(self.merged_by)   # a copy: the server thread goes on counting
        d["busy_fraction"] = busy_fraction(self.thread_cpu_s, self.thread_wall_s)
        del d["latency_ms"], d["replies_timed"]
        d["commit_latency"] = latency_summary(list(self.latency_ms), self.replies_timed)
        return d


@dataclass(frozen=True)
class LostRank:
    """A rank the server dropped: when (seconds since the run started), why, and what it had
    contributed (commits seen, of them merged; merged deltas stay in the global model)."""

    rank: int
    at_s: float
    why: str
    commits: int
    merged: int


class JoinRefused(ValueError):
    """A replacement cannot have a slot (none is free, the run is over, another model)."""


@dataclass
class OutgoingReply:
    dest: "int | bytes"               # a rank, or a replacement's identity before it has one
    header: Header
    payload: Optional[torch.Tensor]   # the global model (or its downlink copy), or None
    plan: Optional[Plan] = None       # sent right after the model when PLAN_FOLLOWS


class ParameterServer:
    """Global model (flat fp32), merge rule and SHL staleness gate. Not thread-safe by itself:
    ServerThread serialises every call."""

    def __init__(self, initial: torch.Tensor, n_ranks: int, coordinator: Coordinator, *,
                 rank: int = 0, staleness: "str | Staleness" = "none", bound: int = 3,
                 downlink: torch.dtype = torch.float32, outer: Optional[OuterOptimizer] = None,
                 silence_s: Optional[float] = None, silence_rounds: float = 3.0,
                 strategy: str = "ashl", clock: Callable[[], float] = time.monotonic,
                 staging: Optional[WireStaging] = None):
        """`staging`: the global model lives on that device (global_model_on="device"):
        each commit's bytes are copied there before the merge, and a reply's model comes
        back to host memory once per version."""
        if initial.dtype != torch.float32 or initial.dim() != 1:
            raise ValueError("the global model must be a flat fp32 tensor")
        if bound < 0:
            raise ValueError(f"staleness bound must be >= 0, got {bound}")
        if downlink not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"downlink dtype must be float32, float16 or bfloat16, got {downlink}")
        self.model = initial.detach().clone().contiguous()
        self.outer = make_outer("none", self.model.numel(), n_ranks) if outer is None else outer
        if self.outer.numel != self.model.numel():
            raise ValueError(f"the outer optimizer is for {self.outer.numel} elements, the "
                             f"global model has {self.model.numel()}")
        self.n_ranks = n_ranks
        self.rank = rank             # where the server runs: the sender of every reply
        self.strategy = strategy     # what a replacement must run
        self.coordinator = coordinator
        self.staleness = parse_staleness(staleness)
        self.bound = int(bound)
        self.downlink = downlink
        self._downlink_buf = None if downlink == torch.float32 else torch.empty(
            self.model.numel(), dtype=downlink, device=self.model.device)
        self._downlink_version = -1
        self._downlink_host: Optional[torch.Tensor] = None
        self.staging = staging
        # a global model on a GPU is merged on a CUDA stream of its own, apart from the
        # training thread's kernels; ordered against the caller's at start and end
        self.cuda_stream = (torch.cuda.Stream(self.model.device)
                            if self.model.device.type == "cuda" else None)
        self.clock = clock
        self.version = 0
        self.live = set(range(n_ranks))
        self.shl_commits = [0] * n_ranks
        self.waiting: dict[int, Header] = {}     # rank -> the header its reply answers
        self.stats = ServerStats(merged_by=[0] * n_ranks)
        self.left: set[int] = set()              # ranks that finished or were told to stop
        self.vacant: set[int] = set()            # lost ranks whose slot no replacement took
        self.undelivered: set[int] = set()       # left, but their STOP reply did not arrive
        # Fault tolerance (None: fail-stop, nobody is ever dropped for silence)
        self.silence_s, self.silence_rounds = silence_s, float(silence_rounds)
        self.last_heard = [clock()] * n_ranks
        # each rank's recent rounds: from a reply to its next commit
        self.replied_at: list[Optional[float]] = [None] * n_ranks
        self.rounds = [deque(maxlen=5) for _ in range(n_ranks)]
        self.replied_version = [0] * n_ranks    # the version of each rank's latest reply
        self.commit_rate = 0    # adsp's c_target, carried by every reply (REPLY.local_steps)

    # ------------------------------------------------------------------ queries
    @property
    def stopped(self) -> bool:
        return self.coordinator.machine.done

    def slowest_shl(self) -> int:
        live = [self.shl_commits[r] for r in self.live]
        return min(live) if live else max(self.shl_commits)

    def excess(self, staleness: int, in_flight: int = 0) -> int:
        """The staleness a delta is damped for: the versions merged since its base beyond
        one commit of every other live rank. Ranks that train side by side each commit once a
        round, so a delta is normally n - 1 versions old; that is the round's own merge
        (the merge weights already share it out), not lateness. An overlapped commit's steps
        began on the model before its previous reply: the `in_flight` versions between its
        base and that reply are its previous round's, expected as well."""
        return max(0, staleness - in_flight - (len(self.live) - 1))

    def in_flight(self, header: Header) -> int:
        """Versions between a commit's base and the reply its rank had last (> 0 only for a
        commit that overlapped that reply's flight)."""
        return max(0, self.replied_version[header.rank] - header.base_version)

    @property
    def lost_ranks(self) -> set[int]:
        return {x.rank for x in self.stats.lost}

    def silent(self) -> list[tuple[int, str]]:
        """Live ranks (not this one, not held back, with rounds seen) not heard from since
        their last reply for longer than max(silence_s, silence_rounds x their longest recent
        round): a hung process (a dead or cut-off one the transport reports sooner)."""
        if self.silence_s is None:
            return []
        now, out = self.clock(), []
        for r in sorted(self.live - {self.rank} - set(self.waiting)):
            if not self.rounds[r]:
                continue
            limit = max(self.silence_s, self.silence_rounds * max(self.rounds[r]))
            if now - self.last_heard[r] > limit:
                out.append((r, f"silent for {now - self.last_heard[r]:.1f} s (limit {limit:.1f} s)"))
        return out

    def weight(self, rank: int, stage: Stage) -> float:
        plan = self.coordinator.plan
        return float(plan.stage(stage.planned).merge_weights[rank]) if plan else 1.0 / self.n_ranks

    # ------------------------------------------------------------------ commits
    def handle(self, header: Header, payload: Optional[torch.Tensor]) -> list[OutgoingReply]:
        """Apply one validated message; returns the replies to send now."""
        rank = header.rank
        if header.kind not in (Kind.DENSE_DELTA, Kind.SPARSE_DELTA):
            raise protocol.ProtocolError("kind", f"the server does not take {Kind(header.kind).name}")
        now = self.clock()
        if self.replied_at[rank] is not None:
            self.rounds[rank].append(now - self.replied_at[rank])
        self.last_heard[rank] = now
        stage = header.stage
        staleness = max(0, self.version - header.base_version)
        self.stats.max_staleness = max(self.stats.max_staleness, staleness)
        self.stats.bytes_received += protocol.HEADER_SIZE + header.payload_nbytes
        accepted = False
        if rank not in self.live:   # dropped as lost: its late delta is not merged
            return [self._reply(rank, header, False)]
        if not self.stopped:   # after DONE, late deltas are not merged
            excess = self.excess(staleness, self.in_flight(header))
            weight = self.weight(rank, stage) * self.staleness(excess)
            raw = payload if self.staging is None else self.staging.to_device(payload, "commit")
            accepted = self.outer.step(self.model, Payload.from_message(header, raw), weight)
            if accepted:
                self.version += 1
                self.stats.merged += 1
                self.stats.merged_by[rank] += 1
            else:
                self.stats.rejected_nonfinite += 1
                log.warning("rank %d: commit %d holds NaN/Inf; rejected (rank resumes from the "
                            "global model)", rank, header.commit)
        directive = self.coordinator.on_commit(self._report(header))
        if stage == Stage.SHL:
            self.shl_commits[rank] += 1
        if header.flags & Flag.FINAL:
            self._leave(rank, "finished")
        replies = []
        if self.stopped or rank not in self.live or not self._must_wait(rank, stage, directive):
            replies.append(self._reply(rank, header, accepted, directive))
        else:
            self.waiting[rank] = header.replace(flags=header.flags | (Flag.ACCEPTED if accepted else 0))
            self.stats.waits += 1
        return replies + self._release()

    def stop(self, reason: str) -> list[OutgoingReply]:
        """End the run (e.g. an evaluation reached its target): release every waiting rank."""
        if not self.stopped:
            self.coordinator.stop(reason)
        return self._release()

    def tick(self) -> list[OutgoingReply]:
        """Let time-based stops happen while no commit arrives, drop the ranks that fell
        silent; release whoever it frees."""
        self.coordinator.tick()
        out = [r for rank, why in self.silent() for r in self.lose(rank, why)]
        return out + (self._release() if self.stopped else [])

    def begin(self) -> None:
        """Training starts now: every rank's silence is counted from here."""
        self.last_heard = [self.clock()] * self.n_ranks
        self.replied_at = [None] * self.n_ranks

    def lose(self, rank: int, why: str) -> list[OutgoingReply]:
        """Drop `rank` (gone or silent): no reply waits for it, the coordinator re-plans
        among the survivors; what it merged stays. A rank that had left is lost only if its
        last reply could not be delivered (`undelivered`)."""
        if rank == self.rank or not (rank in self.live or rank in self.undelivered):
            return []
        self.undelivered.discard(rank)
        self.left.discard(rank)
        lost = LostRank(rank=rank, at_s=self.clock() - self.coordinator.machine.start_time,
                        why=why, commits=self.coordinator.machine.commits_of(rank),
                        merged=self.stats.merged_by[rank])
        self.stats.lost.append(lost)
        self.live.discard(rank)
        self.vacant.add(rank)
        self.waiting.pop(rank, None)
        log.warning("rank %d lost at %.1f s (%s) after %d commits, %d merged; %d ranks live",
                    rank, lost.at_s, why, lost.commits, lost.merged, len(self.live))
        if not self.stopped:
            self.coordinator.lose(rank, f"rank {rank} lost: {why}")
        return self._release()

    def _must_wait(self, rank: int, stage: Stage, directive: Directive) -> bool:
        return (stage == Stage.SHL and directive.stage == Stage.SHL
                and self.shl_commits[rank] - self.slowest_shl() > self.bound)

    def _release(self) -> list[OutgoingReply]:
        out = []
        for rank, header in list(self.waiting.items()):
            if self.stopped or self.shl_commits[rank] - self.slowest_shl() <= self.bound:
                del self.waiting[rank]
                out.append(self._reply(rank, header, bool(header.flags & Flag.ACCEPTED)))
        return out

    def admit(self, request: dict) -> int:
        """A replacement takes the lowest lost slot: it is live from now on, the coordinator
        re-plans with it (its measured compute time; the slot's link until its commits report
        one), and SHL's bound counts it from the slowest rank's commits. JoinRefused says why
        it cannot."""
        free = sorted(self.vacant)
        if not isinstance(request, dict):
            raise JoinRefused(f"its request is not a JSON object: {request!r:.80}")
        if self.stopped:
            raise JoinRefused("the run is over")
        if not free:
            raise JoinRefused("no rank has been lost: a replacement takes a lost rank's slot")
        if request.get("strategy") != self.strategy:
            raise JoinRefused(f"it runs strategy {request.get('strategy')!r}, the run "
                              f"{self.strategy!r}")
        if request.get("numel") != self.model.numel():
            raise JoinRefused(f"its model has {request.get('numel')} elements, the run's "
                              f"{self.model.numel()}")
        compute_s = request.get("compute_s")
        if not positive_seconds(compute_s):
            raise JoinRefused(f"its compute time per step {compute_s!r} is not a number > 0")
        slot = free[0]
        self.vacant.discard(slot)
        self.shl_commits[slot] = self.slowest_shl()
        self.live.add(slot)
        self.left.discard(slot)
        self.last_heard[slot], self.replied_at[slot] = self.clock(), None
        self.rounds[slot].clear()
        log.warning("a replacement on %s takes rank %d's slot; %d ranks live",
                    request.get("host", "?"), slot, len(self.live))
        self.coordinator.rejoin(slot, float(compute_s), f"a replacement took rank {slot}'s slot")
        return slot

    def _leave(self, rank: int, why: str) -> None:
        if rank in self.live:
            self.live.discard(rank)
            self.left.add(rank)
            log.info("rank %d %s; %d ranks live", rank, why, len(self.live))

    def _report(self, h: Header) -> CommitReport:
        opt = lambda x: None if math.isnan(x) else x  # noqa: E731 - NaN is "not measured"
        link = opt(h.link_s)
        return CommitReport(rank=h.rank, plan_version=h.plan_version, step_s=opt(h.step_s),
                            link_s=link, link_ratio=h.link_ratio, loss=opt(h.loss),
                            samples=h.samples, local_steps=h.local_steps, epoch=h.epoch)

    def _reply(self, rank: int, asked: Header, accepted: bool,
               directive: Optional[Directive] = None) -> OutgoingReply:
        if directive is None:
            directive = self.coordinator.directive(asked.plan_version)
        if directive.stage == Stage.SHL and asked.kind in (Kind.DENSE_DELTA, Kind.SPARSE_DELTA):
            lead = self.shl_commits[rank] - self.slowest_shl()
            self.stats.max_shl_lead = max(self.stats.max_shl_lead, lead)
            self.stats.shl_log.append((rank, self.shl_commits[rank], self.slowest_shl()))
        flags = Flag(0)
        if accepted:
            flags |= Flag.ACCEPTED
        if directive.stop or rank not in self.live:
            flags |= Flag.STOP
        if rank in self.vacant:
            flags |= Flag.DROPPED
        if directive.plan is not None:
            flags |= Flag.PLAN_FOLLOWS
        if flags & Flag.STOP:
            self._leave(rank, "stopped")   # told to stop: it sends nothing more
        self.replied_at[rank] = self.last_heard[rank] = self.clock()   # its next round begins
        self.replied_version[rank] = self.version
        body = self._downlink()
        header = Header(kind=Kind.REPLY, rank=self.rank, stage=directive.stage,
                        commit=asked.commit, base_version=self.version,
                        plan_version=directive.plan_version, dtype=protocol.DType.of(body.dtype),
                        numel=body.numel(), flags=flags, local_steps=self.commit_rate,
                        epoch=directive.shares_epoch)
        return OutgoingReply(rank, header, body, directive.plan)

    def _downlink(self) -> torch.Tensor:
        """What a reply carries: the global model, or its copy in the downlink dtype, in
        host memory (a device model's is copied there once per version)."""
        if self._downlink_buf is None and self.staging is None:
            return self.model
        if self._downlink_version != self.version:
            body = (self.model if self._downlink_buf is None
                    else self._downlink_buf.copy_(self.model))
            self._downlink_host = (body if self.staging is None
                                   else self.staging.to_host_flat(body, "reply"))
            self._downlink_version = self.version
        return self._downlink_host

    # ------------------------------------------------------------------ streams
    def stream(self):
        """The context the server's work runs in: its CUDA stream for a global model on a
        GPU, else nothing."""
        return (contextlib.nullcontext() if self.cuda_stream is None
                else torch.cuda.stream(self.cuda_stream))

    def after_caller(self) -> None:
        """The server's stream waits for the work the calling thread has queued on its own
        (what wrote the initial model, the outer state, a checkpoint's): before the server
        thread starts merging into them."""
        if self.cuda_stream is not None:
            self.cuda_stream.wait_stream(torch.cuda.current_stream(self.model.device))

    def before_caller(self) -> None:
        """The calling thread's stream waits for every merge queued on the server's: before
        it reads (or overwrites) the model the server thread has left."""
        if self.cuda_stream is not None:
            torch.cuda.current_stream(self.model.device).wait_stream(self.cuda_stream)

    def model_copy(self, device) -> torch.Tensor:
        """A copy of the global model on `device`, while the server thread runs (under its
        lock): taken on the server's stream after the merges queued there, and complete
        before the lock is released, so no later merge can reach it."""
        with self.stream():
            copy = self.model.to(device, copy=True)
        if self.cuda_stream is not None:
            self.cuda_stream.synchronize()
            if copy.is_cuda:    # made on the server's stream, used on the caller's: the
                # allocator must not hand its memory to the server before the caller is done
                copy.record_stream(torch.cuda.current_stream(copy.device))
        return copy

    def snapshot(self) -> tuple[torch.Tensor, dict]:
        """The global model and the outer optimizer's state in host memory, while the server
        thread runs (under its lock): copied on the server's stream, after the merges
        queued there, and waited for, so no later merge can reach them."""
        model = self.model_copy("cpu")
        with self.stream():
            outer = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v
                     for k, v in self.outer.state_dict().items()}   # state_dict copies
        return model, outer


class ServerThread:
    """Runs a ParameterServer on this rank: receive, handle, reply, until every rank left."""

    def __init__(self, server: ParameterServer, end: ServerEnd, *,
                 lock: Optional[threading.Lock] = None, tick_s: float = 0.25,
                 threads: Optional[int] = None):
        self.server = server
        self.end = end
        # The CPU kernels' threads for this thread's merges (OpenMP's setting is per
        # thread); None: OpenMP's default, OMP_NUM_THREADS or every core.
        self.threads = threads
        self.lock = lock or threading.Lock()   # shared with whoever else reads the coordinator
        self.error: Optional[BaseException] = None
        self._stop_reason: Optional[str] = None
        self.tick_s = tick_s
        self._thread = threading.Thread(target=self._run, name="ashl-server", daemon=True)

    def start(self) -> "ServerThread":
        with self.lock:
            self.server.begin()
            self.server.after_caller()
        self._thread.start()
        return self

    def request_stop(self, reason: str) -> None:
        """From any thread: end the run; the server thread releases and answers everyone."""
        self._stop_reason = reason

    def _clocks(self) -> None:
        """The thread's CPU and wall time so far, into the stats (under the lock: the
        training thread reads them)."""
        with self.lock:
            self.server.stats.thread_cpu_s = time.thread_time() - self._cpu0
            self.server.stats.thread_wall_s = time.monotonic() - self._wall0

    def _run(self) -> None:
        if self.threads is not None:
            kernels.set_num_threads(self.threads)
        with self.server.stream():
            self._loop()

    def _loop(self) -> None:
        self._cpu0, self._wall0 = time.thread_time(), time.monotonic()
        next_tick = time.monotonic() + self.tick_s
        try:
            while self.server.live:
                self._clocks()
                if self._stop_reason is not None or time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self.tick_s
                    reason, self._stop_reason = self._stop_reason, None
                    with self.lock:
                        replies = self.server.stop(reason) if reason else self.server.tick()
                    self._send_all(replies)
                try:
                    event = self.end.poll(max(0.0, next_tick - time.monotonic()))
                except protocol.ProtocolError as exc:
                    self.server.stats.rejected_invalid += 1
                    log.error("rejected a malformed message: %s", exc)
                    continue
                self._serve(event)
            self.end.drain()   # the last replies reach their ranks before the thread ends
            self._clocks()
        except BaseException as exc:  # noqa: BLE001 - reported to the training thread
            self.error = exc
            log.exception("the parameter server failed")
            self.end.close()   # every rank's end sees it go, none waits for a reply for ever

    def _serve(self, event) -> None:
        """One commit, one lost peer, or one replacement asking to join, from the transport."""
        if event is None:
            return
        if isinstance(event, JoinRequest):
            self._admit(event)
            return
        if isinstance(event, StalePeer):   # dropped, and its slot taken: it is out
            log.warning("a message from rank %d's former process: told it was dropped",
                        event.rank)
            self.end.send(event.peer, Header(kind=Kind.REPLY, rank=self.server.rank,
                                             stage=Stage.DONE, flags=Flag.STOP | Flag.DROPPED))
            return
        if isinstance(event, PeerLost):
            with self.lock:
                replies = self.server.lose(event.rank, event.why)
            self._send_all(replies)
            return
        received = time.perf_counter()
        with self.lock:
            try:
                replies = self.server.handle(event.header, event.payload)
            except (protocol.ProtocolError, IndexError, ValueError) as exc:
                self.server.stats.rejected_invalid += 1
                log.error("rank %d: rejected commit %d: %s", event.header.rank,
                          event.header.commit, exc)
                replies = [self.server._reply(event.header.rank, event.header, False)]
        self._send_all(replies)
        self._time_reply(replies, event.header, received)

    def _time_reply(self, replies: list[OutgoingReply], asked: Header, received: float) -> None:
        """The commit's latency at the server, if its reply went out now (not held)."""
        if any(r.dest == asked.rank and r.header.commit == asked.commit for r in replies):
            stats = self.server.stats
            with self.lock:
                stats.replies_timed += 1
                stats.latency_ms.append((time.perf_counter() - received) * 1e3)

    def _admit(self, request: JoinRequest) -> None:
        """Answer a replacement: its slot and the run's size (SUMMARY), then the global model
        and the plan, as to a commit; or why not."""
        try:
            with self.lock:
                slot = self.server.admit(request.message.json())
                reply = self.server._reply(slot, request.message.header, False)
        except (JoinRefused, protocol.ProtocolError, ValueError, TypeError) as exc:
            log.warning("refused a replacement: %s", exc)
            self._send_json(request.peer, {"error": str(exc)})
            return
        identity = rank_identity(slot)
        self.end.assign(slot, identity)   # that connection, and no other, is the slot now
        self._send_json(request.peer, {"rank": slot, "size": self.server.n_ranks,
                                       "server_rank": self.server.rank,
                                       "identity": identity.decode()})
        self._send(dataclasses.replace(reply, dest=request.peer))

    def _send_json(self, dest: "int | bytes", obj: dict) -> bool:
        body = protocol.json_payload(obj)
        return self.end.send(dest, Header(kind=Kind.SUMMARY, rank=self.server.rank,
                                          stage=self.server.coordinator.stage,
                                          dtype=protocol.DType.UINT8, numel=body.size), body)

    def _send_all(self, replies: list[OutgoingReply]) -> None:
        for r in replies:
            if not self._send(r):
                with self.lock:
                    if r.header.flags & Flag.STOP:
                        self.server.undelivered.add(r.dest)
                    more = self.server.lose(r.dest, "unreachable when its reply was sent")
                self._send_all(more)

    def _send(self, r: OutgoingReply) -> bool:
        header = r.header.replace(sent_at=time.monotonic())   # emulated links deliver from it
        if not self.end.send(r.dest, header, r.payload):
            return False
        if r.header.flags & Flag.PLAN_FOLLOWS:
            body = protocol.json_payload(r.plan.to_dict())
            return self.end.send(r.dest, Header(kind=Kind.PLAN, rank=self.server.rank,
                                                stage=r.header.stage,
                                                plan_version=r.header.plan_version,
                                                dtype=protocol.DType.UINT8, numel=body.size),
                                 body)
        return True

    def send_final(self, model: torch.Tensor, summary: dict) -> list[int]:
        """After join(), fault-tolerant runs: the final model and the run's summary to every
        rank that left the run normally (not this one); the ranks it reached."""
        reached = []
        for rank in sorted(self.server.left - {self.server.rank}):
            reply = Header(kind=Kind.REPLY, rank=self.server.rank, stage=Stage.DONE,
                           base_version=self.server.version, flags=Flag.STOP,
                           dtype=protocol.DType.FLOAT32, numel=model.numel())
            if (self.end.send(rank, reply, model, until_written=True)
                    and self._send_json(rank, summary)):
                reached.append(rank)
        return reached

    def join(self, timeout: Optional[float] = None) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.server.before_caller()   # the caller reads the model next
        if self.error is not None:
            raise RuntimeError("the parameter server failed") from self.error
