"""Strategies that train through the parameter server: ``ashl``, ``ssp``, ``asp``, ``adsp``.

How they communicate: after its round a rank packs its delta (params - anchors, plus any
error-feedback residual) through a ``Compressor`` into the send buffer and commits it with
``client.ServerClient``; the server thread on ``server_rank`` merges it into the global model
(``server.ParameterServer``: merge weight x staleness damping, the outer optimizer,
non-finite guard, SHL's staleness bound) and answers with the global model, which becomes the rank's parameters and
anchors. Stage and stop decisions are the server's coordinator's; they reach a rank with the
reply to its commit. The server rank evaluates the global model between its steps.

A subclass supplies the plan (profiled for ``ashl``, fixed for the baselines) and when a
round ends.

``overlap=True``: a rank keeps taking local steps while its commit is in flight (at most one),
checks for the reply between steps, and continues from the reply's model plus its own progress
since the send (overlap.py); at its next round's end it waits for a reply still in flight.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from typing import Optional

import torch

from .. import checkpoint, kernels
from ..client import Commit, Reply, ServerClient
from ..compression import Compression, Compressor, Residual, check_compression
from ..coordinator import DriftConfig, MPICoordinator, positive_seconds
from ..emulation import Heterogeneity
from ..outer import make_outer
from ..overlap import add_progress, take_progress
from ..outer_spec import parse_outer, resolve_outer
from ..planner import Plan, PlannerConfig, make_plan
from ..server import ParameterServer, ServerThread
from ..stages import Stage, StageConfig
from ..staging import WireStaging
from ..torch.exit import start_watchdog
from ..transport import ZmqRankEnd, advertised_hosts, open_ends
from . import DEFAULT_TRANSPORT, transport_problem
from .base import Strategy
from .model_state import verify_same_model
from .join import join_the_scripts_horovod
from .runtime import is_mpi, world_comm

log = logging.getLogger("ashl")

JOIN_ENV = "ASHL_JOIN"    # tcp://host:port of a fault-tolerant run's server: join it
STARTUP_TIMEOUT_S = 600.0  # fault-tolerant runs: profiling and planning end within this
                           # (or 60 fault timeouts), else a rank was lost before training
HUNG_TIMEOUTS = 6          # a live but hung rank: silent 6 fault timeouts (or 3 of its rounds)


def check_fault_tolerance(fault_tolerant, timeout_s) -> bool:
    """fault_tolerant= must be a bool and fault_timeout_s= a number of seconds > 0."""
    if not isinstance(fault_tolerant, bool):
        raise ValueError(f"fault_tolerant must be True or False, got {fault_tolerant!r}")
    if not positive_seconds(timeout_s):
        raise ValueError(f"fault_timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    return fault_tolerant


def check_transport(transport, fault_tolerant: bool) -> str:
    """transport= must be 'zmq' or 'mpi', and 'zmq' for a fault-tolerant run."""
    problem = transport_problem(transport, fault_tolerant)
    if problem is not None:
        raise ValueError(f"transport={transport!r}: {problem}")
    return transport
GLOBAL_MODEL_PLACES = ("host", "device")


def check_global_model_on(where) -> str:
    """global_model_on= must be 'host' or 'device'."""
    if where not in GLOBAL_MODEL_PLACES:
        raise ValueError(f"global_model_on must be 'host' (the global model in host memory) or "
                         f"'device' (on the server rank's model device), got {where!r}")
    return where


def check_server_threads(threads) -> Optional[int]:
    """server_threads= is None (OpenMP's default) or an integer >= 1."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"server_threads must be None (OpenMP's default: OMP_NUM_THREADS or "
                         f"every core) or an integer >= 1, got {threads!r}")
    return threads


def check_overlap(overlap, default: bool) -> bool:
    """overlap= must be a bool, or None for the strategy's default."""
    if overlap is None:
        return default
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True, False or None (the strategy's default), "
                         f"got {overlap!r}")
    return overlap


def join_endpoint(fault_tolerant: bool) -> Optional[str]:
    """ASHL_JOIN's endpoint when this process is a replacement: only for a fault-tolerant
    optimizer in a process launched alone (a leftover variable must not turn a job's ranks
    into replacements)."""
    join = os.environ.get(JOIN_ENV) or None
    if join is None:
        return None
    if not fault_tolerant:
        raise ValueError(f"{JOIN_ENV}={join} is set: a replacement joins a fault-tolerant run; "
                         "pass fault_tolerant=True, or unset it")
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() > 1:
        raise ValueError(f"{JOIN_ENV}={join} is set, but this process is one of "
                         f"{MPI.COMM_WORLD.Get_size()} ranks of its own launch: a replacement "
                         f"starts alone (unset {JOIN_ENV} for the run's ranks)")
    return join


class ServerStrategy(Strategy):
    """The commit, the reply, the server thread, the end and checkpoints of a run on the
    parameter server."""

    accepts_compression = ("none", "fp16", "topk")
    default_outer = "none"          # outer_optimizer=None: this (outer.py)
    overlaps_by_default = False     # overlap=None: this

    def __init__(self, model, params, *, sampler=None, comm=None, compression=None,
                 staleness: str = "polynomial(0.5)", bound: int = 3, server_rank: int = 0,
                 downlink: torch.dtype = torch.float32, outer_optimizer: Optional[str] = None,
                 planner_config: Optional[PlannerConfig] = None,
                 stage_config: Optional[StageConfig] = None,
                 drift_config: Optional[DriftConfig] = None,
                 evaluate=None, eval_every_s: float = 2.0, poll_s: float = 2e-4,
                 heterogeneity=None, profile_steps: int = 10, fault_tolerant: bool = False,
                 fault_timeout_s: float = 5.0, startup_timeout_s: Optional[float] = None,
                 transport: str = DEFAULT_TRANSPORT, overlap: Optional[bool] = None,
                 profile_within_epoch: bool = True, global_model_on: str = "host",
                 server_threads: Optional[int] = None):
        self.fault_tolerant = check_fault_tolerance(fault_tolerant, fault_timeout_s)
        self.global_model_on = check_global_model_on(global_model_on)
        self.server_threads = check_server_threads(server_threads)
        self.transport = check_transport(transport, self.fault_tolerant)
        self.overlap = check_overlap(overlap, self.overlaps_by_default)
        self.fault_timeout_s = float(fault_timeout_s)
        # A replacement for a lost rank (ASHL_JOIN=tcp://host:port) starts alone and takes
        # the slot, size and server rank the run's server gives it (_join).
        self.join = join_endpoint(self.fault_tolerant)
        world = world_comm(comm, alone=self.join is not None)
        self._start_watchdog(world, startup_timeout_s)
        super().__init__(model, params, comm=world, sampler=sampler, heterogeneity=heterogeneity,
                         evaluate=evaluate, eval_every_s=eval_every_s,
                         control_rank=0 if self.join else server_rank,
                         stage_config=stage_config, profile_steps=profile_steps,
                         profile_within_epoch=profile_within_epoch)
        verify_same_model(world, self.names, self.tensors)
        self.server_rank = server_rank
        self.compression = self._checked_compression(compression)
        # the plan prices a round as max(steps, round trip) when commits overlap
        self.planner_config = dataclasses.replace(planner_config or PlannerConfig(),
                                                  overlap=self.overlap)
        self.mc = MPICoordinator(world, root=0 if self.join else server_rank,
                                 planner_config=self.planner_config, stage_config=stage_config,
                                 drift_config=drift_config)
        if self.is_server:
            self.mc.coordinator.plan_for = self.plan_for_survivors
        self.staleness, self.bound, self.downlink = staleness, bound, downlink
        self.outer_spec = parse_outer(self.default_outer if outer_optimizer is None
                                      else outer_optimizer)
        self._init_commit_state()
        self._open_wire(world, poll_s)

    def _start_watchdog(self, world, startup_timeout_s: Optional[float]) -> None:
        """Until the plan, every rank meets the others in collectives: one lost there would
        leave them waiting for ever. A watchdog ends the job instead (cancelled in _plan)."""
        self.startup_timeout_s = (max(STARTUP_TIMEOUT_S, 60 * self.fault_timeout_s)
                                  if startup_timeout_s is None else float(startup_timeout_s))
        self._watchdog = (start_watchdog(world.Get_rank(), world.Get_size(),
                                         self.startup_timeout_s)
                          if self.fault_tolerant and self.join is None
                          and is_mpi(world) else None)

    def _checked_compression(self, compression) -> Optional[Compressor]:
        compressor = check_compression(compression, self.name, self.accepts_compression)
        if (compressor is not None and compressor.ratio < 1.0
                and any(t.dtype != torch.float32 for t in self.tensors)):
            raise ValueError(f"compression={compressor!r} needs fp32 parameters and "
                             "buffers: what top-k does not send is kept for the next commit "
                             "(error feedback) in fp32; this model has "
                             f"{sorted({str(t.dtype) for t in self.tensors})}")
        return compressor

    def _open_wire(self, world, poll_s: float) -> None:
        """The commits' and replies' own communicator, the server's end and this rank's."""
        self.wire = world.Dup()              # commits and replies: a tag space of their own
        self.server_end, end = open_ends(self.wire, self.server_rank, self.numel,
                                         transport=self.transport,
                                         fault_tolerant=self.fault_tolerant,
                                         timeout_s=self.fault_timeout_s, poll_s=poll_s,
                                         server_error=self._server_error, join=self.join)
        self.client = ServerClient(end, self.rank, self.numel, heterogeneity=self.hetero,
                                   pinned=self.staging.pinned)

    def _init_commit_state(self) -> None:
        """What the commits carry from one to the next: versions, residuals, the overlap's."""
        self.run_summary: Optional[dict] = None   # fault-tolerant: the server's word on the end
        self.dropped = False                 # the server dropped this rank as lost
        self.anchors: Optional[list[torch.Tensor]] = None
        # top-k and fp16 commits feed back what they left out, where the parameters are fp32;
        # the memory (1 M) is taken at the first such commit, not by strategies that never
        # compress (adsp's, or ashl's AHL)
        self.error_feedback = all(t.dtype == torch.float32 for t in self.tensors)
        self.residual: Optional[Residual] = None
        self.scratch: Optional[torch.Tensor] = None  # fp32 delta for compressors that need it
        self._held = None    # the server rank's own model while the global one is evaluated
        self._evaluated_version: Optional[int] = None   # the version of W evaluated last
        self.server: Optional[ServerThread] = None
        self.version = 0                     # global version of the model we hold
        self.round_base = 0                  # the version this round's steps started from
        self.accepted = 0                    # commits the server said it merged
        # overlap: the model as sent (then the progress since), the commit's timeline span
        self.sent: Optional[list[torch.Tensor]] = None
        self._flight: Optional[tuple] = None
        self.overlap_counts = {"overlapped_steps": 0, "overlapped_commits": 0,
                               "reply_waits": 0, "reply_wait_s": 0.0}
        self._resume: Optional[dict] = None
        # The epoch from which the current plan's and stage's data shares apply, the same on
        # every rank (the coordinator's); None: this rank's next epoch boundary
        self.shares_epoch: Optional[int] = None
        self.late_shares = 0      # shares that changed a pass this rank had begun
        self._evaluated_model: Optional[torch.Tensor] = None   # the model that met the target

    # ------------------------------------------------------------------------ reading
    @property
    def is_server(self) -> bool:
        return self.rank == self.server_rank and self.join is None

    @property
    def join_address(self) -> Optional[str]:
        """Server rank of a fault-tolerant run: what a replacement sets ASHL_JOIN to."""
        if not (self.is_server and self.fault_tolerant):
            return None
        return f"tcp://{advertised_hosts()[0]}:{self.server_end.port}"

    @property
    def join_addresses(self) -> list[str]:
        """Every address of the server's host a replacement may use (the first is
        join_address; a host with several networks needs the one the replacement can reach)."""
        if self.join_address is None:
            return []
        return [f"tcp://{h}:{self.server_end.port}" for h in advertised_hosts()]

    @property
    def lost_ranks(self) -> list[dict]:
        """Fault-tolerant runs: the ranks the server dropped (rank, at_s, why, commits,
        merged), where this rank knows them (the server rank always; the others at the end)."""
        if self.server is not None:
            with self.mc.lock:
                return [dataclasses.asdict(x) for x in self.server.server.stats.lost]
        return list((self.run_summary or {}).get("lost", []))

    def machine(self):
        return self.mc.coordinator.machine if self.is_server else None

    @property
    def stop_reason(self) -> Optional[str]:
        if self.is_server:
            with self.mc.lock:
                return self.mc.coordinator.machine.stop_reason
        return self._stop_reason

    @property
    def global_commits(self) -> Optional[int]:
        if not self.is_server:
            return None
        with self.mc.lock:
            return self.mc.coordinator.machine.commits

    def compressor(self) -> Compressor:
        """The user's (every commit), else the plan's: top-k at this rank's ratio R_i of the
        stage (the default plan: dense in AHL, R_i < 1 in SHL), with error feedback, so only
        where the parameters are fp32; dense otherwise."""
        if self.compression is not None:
            return self.compression
        ratio = self.plan.ratio(self.rank, self.stage.planned) if self.plan else 1.0
        if ratio < 1.0 and self.error_feedback:
            return Compression.topk(ratio)
        return Compression.none

    def compression_samples(self, repeats: int = 3) -> list[float]:
        """Seconds to build this rank's top-k delta at the plan's target ratio, timed on its
        own tensors (the first call is warm-up): the planner's g_i, which a stage that
        compresses adds to every round. Nothing when the plan never compresses: a forced
        compressor, parameters without error feedback, or dense targets."""
        cfg = self.planner_config
        ratio = min(cfg.shl_target_ratio, cfg.ahl_target_ratio)
        if ratio >= 1 or self.compression is not None or not self.error_feedback:
            return []
        compressor = Compression.topk(ratio)
        if self.scratch is None:
            self.scratch = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        out = torch.empty(compressor.max_nbytes(self.numel), dtype=torch.uint8,
                          device=self.device)
        residual = Residual(self.tensors)   # zeros: the rank's own stays as it is
        samples = []
        for _ in range(1 + repeats):
            self.wait_for_device()
            t0 = time.perf_counter()
            compressor.pack(self.tensors, self.anchors, residual, self.scratch, out)
            self.wait_for_device()
            samples.append(time.perf_counter() - t0)
        return samples

    def _server_error(self) -> Optional[BaseException]:
        return None if self.server is None else self.server.error

    def take_commit_rate(self, rate: int) -> None:
        """A reply's commit-rate target (adsp's scheduler; 0: none)."""

    def plan_for_survivors(self, profiles) -> Plan:
        """The plan of a subset of the ranks (the survivors of a lost one), index j = the
        j-th survivor: profiled ranks re-plan from their profiles."""
        return make_plan(profiles, self.planner_config)

    # ----------------------------------------------------------------------- the round
    def _start(self) -> None:
        # The model as broadcast before training: the anchor of the first delta and, on
        # the server rank, the first global model.
        self.anchors = kernels.clone_tensors(self.tensors)
        if self.join is None:
            self.check_every_rank_resumes()
        if self._resume is not None:
            self._start_from_checkpoint()

    def _plan(self) -> None:
        if self.join is not None:
            self.planned = True
            self._join()
        else:
            super()._plan()
        self._started_up()

    def _started_up(self) -> None:
        """The start-up's collectives are over (the plan, or a checkpoint's resume)."""
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _join(self) -> None:
        """A replacement, at the end of its timed first steps: ask the run's server for a lost
        rank's slot; take that rank, the run's size, the global model, the plan and stage.
        Its own first steps are discarded (they trained another model)."""
        steps = self.profiler.samples["compute"][1:] or self.profiler.samples["compute"]
        info, reply = self.client.join({"compute_s": statistics.median(steps) if steps else 1e-3,
                                        "host": self.host, "numel": self.numel,
                                        "strategy": self.name})
        if reply is None:
            raise RuntimeError(f"{JOIN_ENV}={self.join}: the run's server refused this "
                               f"replacement: {info['error']}")
        self.rank, self.size = int(info["rank"]), int(info["size"])
        self.server_rank = self.control_rank = int(info["server_rank"])
        self.timeline.rank = self.rank
        self.client.close()
        self.client.end.close()
        self.client.end = ZmqRankEnd(self.join, self.rank, self.numel, world_size=self.size,
                                     server_rank=self.server_rank, timeout_s=self.fault_timeout_s,
                                     identity=info["identity"].encode())
        self.client.rank = self.rank
        if self.emulated_from_env:     # the slot's emulated speed, as its launched rank had
            self.hetero = self.client.hetero = Heterogeneity.from_env(self.rank)
            self.slowdown = self.hetero.slowdown()
        kernels.unpack_assign(self.tensors, self.anchors, self.staging.to_device(reply.model))
        self.clear_optimizer_state()   # its first steps' momentum was for another model
        self.round_steps = 0           # and those steps are not the slot's
        self.clock.new_round()
        self.version, self.stage = reply.version, reply.stage
        self.round_base = self.version
        self.take_commit_rate(reply.commit_rate)
        self.mc.plan = reply.plan
        if hasattr(self.sampler, "rebind"):
            self.sampler.rebind(self.rank, self.size)
        self.adopt_plan(reply.plan)
        log.warning("%s: this replacement took rank %d's slot of %d (global version %d)",
                    self.name, self.rank, self.size, self.version)

    def _start_server(self, model: torch.Tensor) -> None:
        # The global model: in host memory, where the commits arrive (the default), or on
        # this rank's model device, each commit copied there (docs/DESIGN.md); the server
        # thread's stream follows this thread's at start(), and this one its at join().
        on_device = self.global_model_on == "device"
        model = model.to(self.device if on_device else "cpu")
        # delayed-nesterov's n defaults to one round: one commit of every rank
        outer = make_outer(self.outer_spec, self.numel, round_updates=self.size,
                           device=model.device, params_numel=self.params_numel)
        server = ParameterServer(model, self.size, self.mc.coordinator, rank=self.rank,
                                 staleness=self.staleness, bound=self.bound,
                                 downlink=self.downlink, outer=outer,
                                 silence_s=HUNG_TIMEOUTS * self.fault_timeout_s
                                 if self.fault_tolerant else None, strategy=self.name,
                                 staging=WireStaging(self.device) if on_device else None)
        self.server = ServerThread(server, self.server_end, lock=self.mc.lock,
                                   threads=self.server_threads)

    def _exchange(self, final: bool = False) -> None:
        if self.round_steps == 0 and not final:
            return      # a replacement that has just joined: nothing of its own to commit
        if self.client.inflight is not None:
            self._land(wait=True)   # one commit in flight at most: the round's end waits
            if self.finished:
                return              # its reply ended the run: this round is not sent
        start = time.time()
        stage, steps = self.stage, self.round_steps
        payload = self._pack(self.compressor())
        commit = Commit(
            stage=stage, number=self.commits, base_version=self.round_base,
            plan_version=self.plan.version, epoch=self.current_epoch(), local_steps=steps,
            step_s=self.clock.round_mean(), loss=self.loss.commit(), final=final)
        self.commits += 1
        self.round_steps = 0
        self.clock.new_round()
        if self.overlap and not final:
            self._send_overlapped(payload, commit, start, stage)
            return
        reply = self.client.commit(payload, commit)
        self.bytes_sent += reply.bytes_sent
        self._absorb(reply, final)
        self.round_base = self.version
        self.round_span(start, steps=steps, stage=stage.value, bytes=reply.bytes_sent,
                        accepted=reply.accepted, version=self.version)

    # --------------------------------------------------------------- overlapped commits
    def _send_overlapped(self, payload, commit: Commit, start: float, stage: Stage) -> None:
        """Start the commit and return to training: the next round's steps start from the
        model held now (w_sent, copied), on the version held now."""
        if self.sent is None:
            self.sent = kernels.clone_tensors(self.tensors)
        else:
            sent, held = kernels.flat_forms(self.sent, self.tensors)
            torch._foreach_copy_(list(sent), list(held))
        self.bytes_sent += self.client.begin(payload, commit)
        self.overlap_counts["overlapped_commits"] += 1
        self.round_base = self.version
        now = time.time()
        self.timeline.span("compute", self._round_wall, start, steps=commit.local_steps)
        self._round_wall = now
        self._flight = (start, stage, commit.number)

    def _between_steps(self) -> None:
        """After every local step: take the in-flight commit's reply if it has arrived; on
        the server rank, evaluate the global model if an evaluation is due and a merge has
        changed it since the last one (the same model would only give the same accuracy
        again, on the device training needs), and take a background evaluation's result
        once it is done."""
        due = self.is_server and self.server is not None and self.evaluations.due() \
            and self.server.server.version != self._evaluated_version
        if self.client.inflight is None and self.evaluations.pending is None and not due:
            return
        t0, evals = time.perf_counter(), self.evaluations.spent_s
        if self.client.inflight is not None:
            self.overlap_counts["overlapped_steps"] += 1   # the step just taken overlapped it
            self._land(wait=False)
        if due:
            self._evaluate_global_model()
        self._take_evaluation()
        evaluating = self.evaluations.spent_s - evals
        self.clock.exclude(time.perf_counter() - t0 - evaluating)
        self.clock.pause(evaluating)

    def _land(self, wait: bool) -> bool:
        """The in-flight commit's reply, if it is here (`wait`: once it is): w <- W + (w -
        w_sent), anchor <- W (overlap.py), unless it was rejected or ended the run (then W
        alone, as without overlap)."""
        t0 = time.perf_counter()
        reply = self.client.reply(wait=wait)
        if reply is None:
            return False
        if wait:
            self.overlap_counts["reply_waits"] += 1
            self.overlap_counts["reply_wait_s"] += time.perf_counter() - t0
        keep = reply.model is not None and reply.accepted and not reply.stop
        if keep:
            take_progress(self.tensors, self.sent)
        self._absorb(reply, final=False)
        start, stage, number = self._flight
        self.timeline.span("commit", start, time.time(), stage=stage.value, overlapped=True,
                           bytes=reply.bytes_sent, accepted=reply.accepted,
                           version=self.version, commit=number)
        if keep:
            add_progress(self.tensors, self.sent)
        return True

    def _pack(self, compressor: Compressor):
        """The commit's payload, packed (and compressed) on the model's device, in host
        memory for the wire: for a CPU model the pack buffer is the wire buffer."""
        out = self.staging.device_buffer("pack", compressor.max_nbytes(self.numel))
        if compressor is not Compression.none:
            if self.scratch is None:
                self.scratch = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            if self.residual is None and self.error_feedback:
                self.residual = Residual(self.tensors)
        return self.staging.to_host(
            compressor.pack(self.tensors, self.anchors, self.residual, self.scratch, out))

    def _absorb(self, reply: Reply, final: bool) -> None:
        """The reply: the global model becomes params and anchors; a plan, a rejection, a
        stage change or a stop is taken on."""
        if reply.model is not None:
            kernels.unpack_assign(self.tensors, self.anchors, self.staging.to_device(reply.model))
        self.shares_epoch = reply.shares_epoch
        if reply.plan is not None:
            self.adopt_plan(reply.plan)
        self.accepted += reply.accepted
        if not (reply.accepted or reply.stop):
            self.rejected += 1
            if self.residual is not None:
                self.residual.zero_()   # error feedback of a rejected delta is garbage too
            self.clear_nonfinite_optimizer_state()
            log.warning("rank %d: commit %d was rejected by the server; resuming from the "
                        "global model", self.rank, self.commits - 1)
        self.version = reply.version
        self.dropped = reply.dropped
        self.take_commit_rate(reply.commit_rate)
        # A rank's own last commit is answered with STOP too: that is not a reason.
        self._follow(Stage.DONE if reply.stop else reply.stage,
                     "the server had dropped this rank as lost" if reply.dropped
                     else "the server ended the run" if reply.stop and not final else None)

    def _evaluate_global_model(self) -> None:
        """Server rank, between steps: start an evaluation of the global model W as the
        server holds it now. On a clock, not at this rank's replies, so a strategy that
        commits every few seconds is evaluated as often as one that commits every step.
        The callback sees W in the model; this rank's own model is put back after it
        returns (a background evaluation has copied W by then). The copies count as the
        evaluation's time. Costs one more copy of the model on this rank, kept."""
        t0, spent = time.perf_counter(), self.evaluations.spent_s
        server = self.server.server
        with self.mc.lock:
            if self.finished or self.mc.coordinator.machine.done:
                return      # the run is ending: nothing evaluated now could change that
            version, global_model = server.version, server.model_copy(self.device)
        if self._held is None:
            self._held = kernels.clone_tensors(self.tensors)
        held, live = kernels.flat_forms(self._held, self.tensors)
        with torch.no_grad():
            torch._foreach_copy_(list(held), list(live))
            try:
                torch._foreach_copy_(list(live), kernels.views_like(global_model, live))
                keep = self.stage_config.target_accuracy is not None
                if self.evaluations.start(save=(lambda: global_model) if keep else None):
                    self._evaluated_version = version
                self._take_evaluation()   # one that returned at once, while W is held
            finally:
                torch._foreach_copy_(list(live), list(held))
                self.evaluations.spent_s = spent + time.perf_counter() - t0

    def _take_evaluation(self) -> None:
        """A finished evaluation's accuracy goes to the coordinator: a target met stops the
        run (the server thread answers the ranks it holds back) and the evaluated model, not
        one with the commits merged since, is the final one."""
        if self.finished or not self.is_server:
            return
        accuracy = self.evaluations.take(wait=False)
        if accuracy is None:
            return
        with self.mc.lock:
            machine = self.mc.coordinator.machine
            was_done = machine.done        # the server thread may have ended the run first
            self.mc.coordinator.on_evaluation(accuracy=accuracy)
            done, reason = machine.done, machine.stop_reason
        if done and not was_done and reason.startswith("target accuracy"):
            # the background evaluation's copy, or (one taken at once) the model held now
            saved = self.evaluations.saved
            self._evaluated_model = self.flat_model() if saved is None else saved
        self.evaluations.saved = None
        if done:
            self.server.request_stop(reason)
        self.timeline.instant("eval", accuracy=accuracy)

    # ------------------------------------------------------------------------- the end
    def _final_model(self) -> None:
        """The server's final global model on every rank, and why the run ended: a
        broadcast, or in a fault-tolerant run (no collective may involve a lost rank) one
        message from the server to every rank that left the run."""
        if not self.fault_tolerant:   # (a lost rank would never join)
            join_the_scripts_horovod()
        final = torch.empty(self.numel, dtype=torch.float32, pin_memory=self.staging.pinned)
        if self.client.inflight is not None and not self.dropped:
            self._land(wait=True)   # its reply must not be taken for the final model
        if self.server is not None:
            self.server.join()      # and this thread's stream waits for the server's merges
            if self._evaluated_model is not None:   # the server's model is that one too
                self.server.server.model.copy_(self._evaluated_model)
            final.copy_(self.server.server.model)
        if self.fault_tolerant:
            self._final_model_by_message(final)
            return
        self.wire.Bcast(final.numpy(), root=self.server_rank)
        kernels.unpack_assign(self.tensors, self.anchors, self.staging.to_device(final))
        reason = self.wire.bcast(self.stop_reason if self.is_server else None,
                                 root=self.server_rank)
        self._stop_reason = reason or self._stop_reason

    def _final_model_by_message(self, final: torch.Tensor) -> None:
        if self.is_server:
            with self.mc.lock:
                stats = self.server.server.stats
                self.run_summary = {"stop_reason": self.mc.coordinator.machine.stop_reason,
                                    "merged": stats.merged, "merged_by": list(stats.merged_by),
                                    "lost": [dataclasses.asdict(x) for x in stats.lost]}
            self.server.send_final(final, self.run_summary)
        elif self.dropped:
            return        # it keeps the global model of its last reply; nobody waits for it
        else:
            model, self.run_summary = self.client.final()
            final.copy_(model)
        kernels.unpack_assign(self.tensors, self.anchors, self.staging.to_device(final))
        self._stop_reason = self.run_summary.get("stop_reason") or self._stop_reason

    def _close(self) -> None:
        self.mc.close(collective=not self.fault_tolerant)
        self.client.close()
        self.client.end.close()
        if self.server_end is not None:
            self.server_end.close()
        self.wire.Free()

    # --------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str, optimizer) -> None:
        """Not collective: the server rank writes the run (global model, plan, stage,
        counters) to ``path``; every rank writes its optimizer state to ``path.rank<r>``."""
        if self.plan is None:
            raise RuntimeError("nothing to checkpoint before profiling has produced a plan")
        if self.is_server:
            with self.mc.lock:
                stage = self.mc.coordinator.stage
                if not stage.training:
                    # the run ended on the server before this rank heard (its epoch's end
                    # raced the last commits): record the stage it ended in, to resume there
                    stage = self.mc.coordinator.machine.transitions[-1].from_stage
                # in host memory, copied after the merges queued on a device model
                model, outer = self.server.server.snapshot()
                run = {"format": checkpoint.FORMAT, "strategy": self.name, "size": self.size,
                       "numel": self.numel, "global_model": model, "outer": outer,
                       "version": self.server.server.version,
                       "plan": self.mc.coordinator.plan.to_dict(),
                       "stage": stage.value,
                       "commits": self.mc.coordinator.machine.commits}
            checkpoint.atomic_save(run, path)
        self._save_own(path, optimizer, residual=None if self.residual is None
                       else self.residual.flat.to("cpu", copy=True))

    def load_checkpoint(self, path: str, optimizer) -> None:
        """Before the first step: continue the run saved at ``path`` (every rank)."""
        if self.started:
            raise RuntimeError("load_checkpoint must be called before the first step()")
        run = checkpoint.load(path)
        checkpoint.check_run(run, path, self.name, self.size, self.numel)
        self._check_outer_state(path, run.get("outer"))
        try:     # here, not at the first step: a plan this version cannot read is refused
            run["plan"] = Plan.from_dict(run["plan"])
            Stage(run["stage"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"checkpoint {path}: its plan or stage cannot be read by this "
                             f"version of ashl ({e}); resume it with the version that saved "
                             "it") from None
        # saved while a lost rank's slot was vacant: its schedule gives that slot nothing, and
        # every rank is re-planned at the start (_start_from_checkpoint)
        vacant = any(h == 0 for h in run["plan"].ahl.local_steps + run["plan"].shl.local_steps)
        # the saved error feedback is read into a residual of its own, kept if it holds any
        residual = Residual(self.tensors) if self.error_feedback else None
        self._load_own(path, optimizer, restore_sampler=not vacant,
                       tensors={} if residual is None else {"residual": residual.flat})
        self.residual = residual if residual is not None and bool(residual.flat.any()) else None
        kernels.unpack_assign(self.tensors, [t.clone() for t in self.tensors],
                              self.staging.to_device(run["global_model"]))
        self._resume = run

    def _check_outer_state(self, path: str, state: Optional[dict]) -> None:
        """Every rank, before any starts: the checkpoint's outer optimizer must be this run's
        (the server rank alone loads it later, so nothing may fail there)."""
        state = state or {"spec": "none", "numel": self.numel, "params": self.params_numel}
        mine = str(resolve_outer(self.outer_spec, self.size))
        if state.get("spec") != mine:
            raise ValueError(f"checkpoint {path} was trained with outer_optimizer="
                             f"{state.get('spec')!r}; this run asks for {mine!r}")
        sizes = [state.get("numel"), state.get("params")] + [
            state[k].numel() for k in ("momentum", "buffer") if k in state]
        if sizes != [self.numel, self.params_numel] + [self.params_numel] * (len(sizes) - 2) \
                or (mine != "none" and "updates" not in state):
            raise ValueError(f"checkpoint {path}: its outer optimizer state does not fit this "
                             f"model ({self.numel} elements, {self.params_numel} of them "
                             "parameters)")

    def _start_from_checkpoint(self) -> None:
        run, self._resume = self._resume, None
        plan = run["plan"]
        if any(h == 0 for h in plan.ahl.local_steps + plan.shl.local_steps):
            # saved while a lost rank's slot was vacant: every rank is back, plan them all
            # (the same on every rank: the strategy's planner is pure)
            plan = dataclasses.replace(self.plan_for_survivors(list(plan.profiles)),
                                       version=plan.version + 1,
                                       reason="resumed with every rank back")
        stage = Stage(run["stage"])
        stage = stage if stage.training else Stage.SHL
        # Each rank saved its part (its sampler's schedule) on its own clock, in its own
        # epoch: the run's shares (now, and a later re-plan's or stage's) apply from one
        # epoch that no rank has begun, the same on every rank.
        epochs = self.comm.allgather(self.current_epoch())
        if self.is_server:
            self.mc.coordinator.resume(plan, stage)
            self.mc.coordinator.note_epochs(epochs)
            self._start_server(run["global_model"].clone())
            if run.get("outer") is not None:     # checked in load_checkpoint
                self.server.server.outer.load_state_dict(run["outer"])
            self.server.server.version = int(run.get("version", 0))
            self.server.start()
        self.version = self.round_base = int(run.get("version", 0))
        self.mc.plan = plan
        self.mc.barrier()   # every rank resumes before anyone commits
        self._started_up()
        self.planned = True
        self.stage = stage
        self.shares_epoch = max(epochs) + 1          # the coordinator's after note_epochs
        self.adopt_plan(plan)

    def _give_shares(self) -> None:
        """The plan's shares for the stage, from the coordinator's shares epoch: the ranks
        hear of a change at different moments, in different epochs, and each epoch must
        still be one permutation of the data across them."""
        if self.plan is None or not hasattr(self.sampler, "set_shares"):
            return
        # a script that never calls set_epoch reads every pass as epoch 0: its next pass
        epoch = self.shares_epoch if getattr(self.sampler, "epochs_told", True) else None
        shares = list(self.plan.stage(self.stage.planned).shares)
        late = getattr(self.sampler, "comes_late", None)
        if epoch is not None and late is not None and late(shares, epoch):
            self.late_shares += 1
            log.warning("rank %d: new data shares apply from epoch %d, which this rank has "
                        "already begun with its old share: unless every rank began it so, "
                        "that epoch reads some samples twice and some never",
                        self.rank, epoch)
        self.sampler.set_shares(shares, epoch=epoch)

    def counters(self) -> dict:
        c = super().counters()
        c["late_shares"] = self.late_shares
        c["version"] = self.version
        c["accepted"] = self.accepted
        c["transport"] = self.transport
        c["overlap"] = {"enabled": self.overlap, **self.overlap_counts}
        c["global_model_on"] = self.global_model_on
        c["server_threads"] = self.server_threads
        if self.join is not None:
            c["replaced_rank"] = self.rank if self.planned else None
        if self.server is not None:
            with self.mc.lock:     # the server thread appends to its stats under the lock
                c["server"] = self.server.server.stats.to_dict()
                outer = self.server.server.outer
                c["outer"] = {"spec": str(outer.spec), "updates": outer.updates}
        if self.fault_tolerant:
            c["lost_ranks"] = self.lost_ranks
            c["dropped"] = self.dropped
        return c
