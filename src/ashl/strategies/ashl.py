"""ASHL through a parameter server: profile, then AHL (dense, asynchronous), then SHL (top-k
with error feedback, bounded staleness), each rank with its own local-step count H_i.

The server runs as a thread on ``server_rank`` (rank 0 by default) beside that rank's
training; every rank, that one included, commits over MPI point-to-point.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from .. import checkpoint, kernels, protocol
from ..compression import Compression, Compressor, Payload, Residual
from ..coordinator import DriftConfig, MPICoordinator
from ..planner import Plan, PlannerConfig
from ..protocol import Flag, Header, Kind, StageCode
from ..server import ParameterServer, ServerThread
from ..stages import Stage, StageConfig
from ..timeline import Timeline, timeline_path, write_chrome_trace
from .base import RoundStrategy, verify_same_model

log = logging.getLogger("ashl")


def mpi_world():
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() == 1 and _launched_by_gloo():
        raise RuntimeError("ashl needs an MPI launch (horovodrun without --gloo, mpirun, or "
                           "srun --mpi=pmix): under Gloo every rank sees an MPI world of size 1")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("ashl's server thread needs MPI_THREAD_MULTIPLE (mpi4py's default "
                           "request); MPI was initialised with less")
    return MPI


def _launched_by_gloo() -> bool:
    import os
    return "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ


class AshlStrategy(RoundStrategy):
    name = "ashl"

    def __init__(self, model, params, *, sampler=None, comm=None, compression=None,
                 staleness: str = "polynomial(0.5)", bound: int = 3, profile_steps: int = 10,
                 server_rank: int = 0, downlink: torch.dtype = torch.float32,
                 planner_config: Optional[PlannerConfig] = None,
                 stage_config: Optional[StageConfig] = None,
                 drift_config: Optional[DriftConfig] = None,
                 evaluate: Optional[Callable[[], float]] = None, eval_every_s: float = 2.0,
                 poll_s: float = 2e-4, heterogeneity=None):
        MPI = mpi_world()
        comm = (MPI.COMM_WORLD if comm is None else comm)
        super().__init__(model, params, sampler=sampler, rank=comm.Get_rank(),
                         size=comm.Get_size(), heterogeneity=heterogeneity)
        if not 0 <= server_rank < self.size:
            raise ValueError(f"server_rank {server_rank} is not a rank of this {self.size}-rank job")
        if profile_steps < 3:
            raise ValueError(f"profile_steps must be >= 3 (one is warm-up), got {profile_steps}")
        verify_same_model(comm, self.names, self.tensors)
        self.comm = comm.Dup()               # commits and replies: a tag space of their own
        self.server_rank = server_rank
        self.mc = MPICoordinator(comm, root=server_rank, planner_config=planner_config,
                                 stage_config=stage_config, drift_config=drift_config)
        self.compression = compression       # None: the plan's R_i (top-k in SHL)
        self.staleness, self.bound, self.downlink = staleness, bound, downlink
        self.profile_steps = profile_steps
        self.evaluate, self.eval_every_s = evaluate, eval_every_s
        self.poll_s = poll_s
        self.anchors: Optional[list[torch.Tensor]] = None
        self.residual = Residual(self.tensors) if all(
            t.dtype == torch.float32 for t in self.tensors) else None
        self.send_buf = torch.empty(4 * self.numel, dtype=torch.uint8)
        # Replies carry the model or a plan's JSON, whichever is larger.
        self.reply_buf = protocol.MessageBuffer(max(4 * self.numel, protocol.MAX_PLAN_BYTES))
        self.server: Optional[ServerThread] = None
        self.version = 0                     # global version of the model we hold
        self.last_link_s: Optional[float] = None
        self.last_ratio = 1.0
        self.rejected = 0
        self.bytes_sent = 0
        self._last_eval = 0.0
        self._resume: Optional[dict] = None
        self.timeline = Timeline(self.rank)
        self._round_start = time.time()

    # ---------------------------------------------------------------- helpers
    @property
    def is_server(self) -> bool:
        return self.rank == self.server_rank

    def local_steps_target(self) -> int:
        if self.stage == Stage.PROFILE:
            return self.profile_steps
        return self.plan.local_steps(self.rank, self.stage.value)

    def compressor(self) -> Compressor:
        if self.compression is not None and self.stage == Stage.SHL:
            return self.compression
        if self.stage == Stage.SHL and self.residual is not None:
            ratio = self.plan.ratio(self.rank, Stage.SHL.value)
            return Compression.topk(ratio) if ratio < 1.0 else Compression.none
        return Compression.none

    # ---------------------------------------------------------------- driving
    def before_step(self) -> None:
        if self.anchors is None:
            # The model as broadcast before training: the anchor of the first delta and,
            # on the server rank, the first global model.
            self.anchors = [t.detach().clone() for t in self.tensors]
            self._round_start = time.time()
            self.clock.restart()
            if self._resume is not None:
                self._start_from_checkpoint()

    def _end_round(self) -> None:
        self._commit()

    def _start_server(self, model: torch.Tensor) -> None:
        server = ParameterServer(model, self.size, self.mc.coordinator, rank=self.rank,
                                 staleness=self.staleness, bound=self.bound,
                                 downlink=self.downlink)
        self.server = ServerThread(server, self.comm, poll_s=self.poll_s, lock=self.mc.lock)

    def _make_plan(self) -> None:
        push, pull = self.mc.measure_link(4 * self.numel)
        emulated = self.hetero.link_delay(protocol.HEADER_SIZE + 4 * self.numel)
        self.profiler.extend("push", [push.mean + emulated])
        self.profiler.extend("pull", [pull.mean + emulated])
        profile = self.profiler.profile(min_warmup=1)
        if self.is_server:
            flat = torch.empty(self.numel, dtype=torch.float32)
            kernels.pack_delta(self.anchors, [torch.zeros_like(a) for a in self.anchors], flat)
            self._start_server(flat)
        plan = self.mc.establish_plan(profile, serve_reports=False)
        if self.server is not None:
            self.server.start()
        self._apply_plan(plan)
        self.stage = Stage.AHL
        self.timeline.instant("plan", version=plan.version, H=self.local_steps_target())

    def _apply_plan(self, plan: Plan) -> None:
        """Adopt a plan; its data shares apply at this rank's next epoch boundary. Shares
        follow speed, so ranks move through epochs together and switch on about the same
        one (a plan's shares_from_epoch is not enforced: a script that never calls
        sampler.set_epoch would never reach it)."""
        self.plan = plan
        if self.sampler is not None and hasattr(self.sampler, "set_shares"):
            stage = self.stage.value if self.stage in (Stage.AHL, Stage.SHL) else Stage.AHL.value
            self.sampler.set_shares(list(plan.stage(stage).shares))

    def current_epoch(self) -> int:
        """The epoch reported with commits: the sampler's, else what set_epoch was told."""
        return int(getattr(self.sampler, "epoch", self.epoch))

    def _commit(self, final: bool = False) -> None:
        if self.server is not None and self.server.error is not None:
            raise RuntimeError("the parameter server failed") from self.server.error
        t_start = time.perf_counter()
        compressor = self.compressor()
        out = self.send_buf[:compressor.max_nbytes(self.numel)]
        sparse = compressor is not Compression.none and compressor.ratio < 1.0
        if sparse:
            delta = torch.empty(self.numel, dtype=torch.float32)
            kernels.pack_delta(self.tensors, self.anchors, delta, residuals=self.residual.views)
            payload = compressor.compress(delta, self.residual, out=out)
        else:
            # Dense fp32: pack straight into the send buffer (plus any residual left over
            # from SHL, so nothing once withheld is lost).
            values = out[:4 * self.numel].view(torch.float32)
            res = self.residual.views if self.residual is not None else None
            kernels.pack_delta(self.tensors, self.anchors, values, residuals=res)
            if self.residual is not None:
                self.residual.zero_()
            payload = Payload(Kind.DENSE_DELTA, protocol.DType.FLOAT32, self.numel, 0,
                              out[:4 * self.numel])
        stage = self.stage
        header = Header(kind=payload.kind, rank=self.rank, stage=StageCode[stage.value],
                        commit=self.commits, base_version=self.version,
                        plan_version=self.plan.version, epoch=self.current_epoch(),
                        local_steps=self.round_steps, dtype=payload.dtype, numel=self.numel,
                        nnz=payload.nnz if payload.sparse else 0,
                        flags=Flag.FINAL if final else Flag(0),
                        samples=self.round_steps, step_s=Header.optional(self.clock.round_mean()),
                        link_s=Header.optional(self.last_link_s), link_ratio=self.last_ratio,
                        loss=Header.optional(self.loss.commit()))
        t_send = time.perf_counter()
        self.link_departure(header.nbytes)
        protocol.send(self.comm, self.server_rank, header, payload.buffer,
                      tag=protocol.TAG_TO_SERVER)
        reply = self._receive()
        self.link_arrival(reply.header.sent_at, reply.header.nbytes)
        t_reply = time.perf_counter()
        self.bytes_sent += header.nbytes
        self.commits += 1
        self.round_steps = 0
        self.clock.new_round()
        h = reply.header
        if h.numel:  # before anything else lands in reply_buf
            kernels.unpack_assign(self.tensors, self.anchors, reply.dense())
        if h.flags & Flag.PLAN_FOLLOWS:
            plan_msg = self._receive()
            self._apply_plan(Plan.from_dict(plan_msg.json()))
            self.timeline.instant("plan", version=self.plan.version,
                                  H=self.plan.local_steps(self.rank, self.stage.value))
        if not h.flags & (Flag.ACCEPTED | Flag.STOP):
            self.rejected += 1
            if self.residual is not None:
                self.residual.zero_()   # error feedback of a rejected delta is garbage too
            self.clear_nonfinite_optimizer_state()
            log.warning("rank %d: commit %d was rejected by the server; resuming from the "
                        "global model", self.rank, header.commit)
        self.version = h.base_version
        new_stage = Stage(StageCode(h.stage).name)
        if new_stage != self.stage:
            self.timeline.instant("stage", stage=new_stage.value)
            if new_stage in (Stage.AHL, Stage.SHL):
                self.stage = new_stage
                self._apply_plan(self.plan)
        if h.flags & Flag.STOP or new_stage == Stage.DONE:
            self.stage = Stage.DONE
            self.finished = True
        self.last_link_s = t_reply - t_send
        self.last_ratio = compressor.ratio if sparse else 1.0
        now = time.time()
        t_commit = now - (time.perf_counter() - t_start)
        self.timeline.span("compute", self._round_start, t_commit, steps=header.local_steps)
        self.timeline.span("commit", t_commit, now, stage=stage.value, bytes=header.nbytes,
                           accepted=bool(h.flags & Flag.ACCEPTED), version=self.version)
        self._round_start = now
        self._maybe_evaluate()

    def _receive(self) -> protocol.Message:
        while not self.comm.Iprobe(source=self.server_rank, tag=protocol.TAG_TO_RANK):
            if self.server is not None and self.server.error is not None:
                raise RuntimeError("the parameter server failed") from self.server.error
            time.sleep(self.poll_s)
        return protocol.recv(self.comm, self.reply_buf, source=self.server_rank,
                             tag=protocol.TAG_TO_RANK, model_numel=self.numel)

    def _maybe_evaluate(self) -> None:
        """Server rank only: the optional evaluation callback on the model just received."""
        if not self.is_server or self.evaluate is None or self.finished:
            return
        now = time.monotonic()
        if now - self._last_eval < self.eval_every_s:
            return
        self._last_eval = now
        accuracy = float(self.evaluate())
        with self.mc.lock:
            self.mc.coordinator.on_evaluation(accuracy=accuracy)
            done = self.mc.coordinator.machine.done
        if done:   # the server thread answers the ranks it holds back
            self.server.request_stop("evaluation reached the target")
        self.timeline.instant("eval", accuracy=accuracy)

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """Leave the run (collective): a final commit unless already stopped, then every rank
        ends with the server's final global model."""
        if self.anchors is None:
            self.before_step()
        if self.plan is None:
            # Stopped before profiling finished: plan now so the collective calls line up.
            if not self.profiler.samples["compute"]:
                self.profiler.record("compute", 1e-3)
            self._make_plan()
        if not self.finished:
            self._commit(final=True)
        self.finished = True
        self.stage = Stage.DONE
        final = torch.empty(self.numel, dtype=torch.float32)
        if self.server is not None:
            self.server.join()
            final.copy_(self.server.server.model)
        self.comm.Bcast(final.numpy(), root=self.server_rank)
        kernels.unpack_assign(self.tensors, self.anchors, final)
        path = timeline_path()
        if path:
            traces = self.comm.gather(self.timeline.events, root=self.server_rank)
            if self.is_server:
                write_chrome_trace(path, traces)
        self.mc.close()
        self.comm.Free()

    # ------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str, optimizer) -> None:
        """Not collective: the server rank writes the run (global model, plan, stage,
        counters) to ``path``; every rank writes its optimizer state to ``path.rank<r>``."""
        if self.plan is None:
            raise RuntimeError("nothing to checkpoint before profiling has produced a plan")
        if self.is_server:
            with self.mc.lock:
                run = {"format": checkpoint.FORMAT, "strategy": self.name, "size": self.size,
                       "numel": self.numel, "global_model": self.server.server.model.clone(),
                       "version": self.server.server.version,
                       "plan": self.mc.coordinator.plan.to_dict(),
                       "stage": self.mc.coordinator.stage.value,
                       "commits": self.mc.coordinator.machine.commits}
            checkpoint.atomic_save(run, path)
        own = {"format": checkpoint.FORMAT, "rank": self.rank, "optimizer": optimizer.state_dict(),
               "counters": self.counters(), "epoch": self.current_epoch(),
               "residual": None if self.residual is None else self.residual.flat.clone()}
        checkpoint.atomic_save(own, checkpoint.rank_path(path, self.rank))

    def load_checkpoint(self, path: str, optimizer) -> None:
        """Before the first step: continue the run saved at ``path`` (every rank)."""
        if self.anchors is not None:
            raise RuntimeError("load_checkpoint must be called before the first step()")
        run = checkpoint.load(path)
        if run.get("size") != self.size:
            raise ValueError(f"checkpoint {path} is of a {run.get('size')}-rank run; "
                             f"this job has {self.size} ranks")
        if run.get("numel") != self.numel:
            raise ValueError(f"checkpoint {path} holds a model of {run.get('numel')} elements; "
                             f"this model has {self.numel}")
        own = checkpoint.load(checkpoint.rank_path(path, self.rank))
        optimizer.load_state_dict(own["optimizer"])
        kernels.unpack_assign(self.tensors, [t.clone() for t in self.tensors],
                              run["global_model"])
        if self.residual is not None and own.get("residual") is not None:
            self.residual.flat.copy_(own["residual"])
        counters = own.get("counters", {})
        self.local_steps = int(counters.get("local_steps", 0))
        self.commits = int(counters.get("commits", 0))
        self.epoch = int(own.get("epoch", 0))
        self._resume = run

    def _start_from_checkpoint(self) -> None:
        run, self._resume = self._resume, None
        plan = Plan.from_dict(run["plan"])
        stage = Stage(run["stage"])
        if stage not in (Stage.AHL, Stage.SHL):
            stage = Stage.SHL
        if self.is_server:
            self.mc.coordinator.resume(plan, stage)
            self._start_server(run["global_model"].clone())
            self.server.server.version = int(run.get("version", 0))
            self.server.start()
        self.version = int(run.get("version", 0))
        self.mc.plan = plan
        self.mc.barrier()   # every rank resumes before anyone commits
        self.stage = stage
        self._apply_plan(plan)
        self.timeline.instant("plan", version=plan.version, resumed=True)

    def counters(self) -> dict:
        c = super().counters()
        c.update(rejected=self.rejected, bytes_sent=self.bytes_sent, version=self.version)
        if self.server is not None:
            c["server"] = self.server.server.stats.to_dict()
        return c
