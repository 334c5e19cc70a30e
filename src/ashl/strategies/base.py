"""The control plane every strategy shares, written once.

A strategy is driven by the wrapped optimizer: ``before_step()`` when ``step()`` is entered
and ``after_step(loss)`` after the local update. ``Strategy`` counts the steps, times them,
keeps the running loss, evaluates on the control rank at its cadence, follows the run's
stage as decided elsewhere (by the parameter server's coordinator or by the allreduced
control numbers), writes the timeline and ends the run. A subclass supplies only what makes
it different, split as torch's model averagers split *when* from *how*:

    _round_done()       when this rank communicates (default: after its H_i local steps)
    _make_plan()        the plan, once, at the end of the first round (collective where the
                        strategy's exchange is)
    _exchange(final)    how it communicates; ends by calling ``_follow(stage, reason)`` with
                        what was decided (a leaving rank's last exchange may not)
    _final_model()      finish(): every rank ends with the same final model
    _close()            finish(): free what the strategy opened

and, if it must, ``on_stage_change(old, new)``: the one hook a rank runs when the run moves
to a new training stage (default: the sampler takes the new stage's data shares).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import socket
import sys
import time
import warnings
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

import torch

from .. import checkpoint, kernels
from ..coordinator import wait_polled
from ..emulation import ComputeSlowdown, Heterogeneity
from ..planner import Plan
from ..device import model_device
from ..staging import WireStaging
from ..stages import RunningLoss, Stage, StageConfig, StageMachine
from ..timeline import Timeline, timeline_path, write_chrome_trace
from .model_state import model_state

log = logging.getLogger("ashl")


def check_sampler(sampler, rank: int, size: int) -> None:
    """A sampler built for another rank or job size reads another rank's slice, silently."""
    replicas, own = getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)
    if replicas is None or own is None or (replicas, own) == (size, rank):
        return
    raise ValueError(f"the sampler was built as rank {own} of {replicas} replicas, but this "
                     f"process is rank {rank} of {size}: build it with num_replicas=hvd.size() "
                     f"and rank=hvd.rank() (hvd.local_rank() is the rank within one host), "
                     f"or leave both out")


def _callers_level() -> int:
    """The warnings stack level of the first frame outside ashl (the user's line)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("ashl."):
        frame, level = frame.f_back, level + 1
    return level


class ProfileBarrier:
    """Has every rank taken its profiling steps? A non-blocking barrier, entered once by a
    rank whose own profiling steps are done and tested after each step it takes on, so that
    the faster ranks keep training (and timing their steps) while the slowest profiles.

    The profile lasts about as long as the fastest rank's steps, not the slowest's: a rank
    entering tells every other rank so, and a rank still profiling stops at `min_steps` (one
    warm-up and two timed) once it hears. Ten steps of an x4 rank took 4 times as long as the
    others' ten, and they trained on alone all that while: about 40 steps each on models that
    the first merge then averaged (docs/BENCHMARKS.md)."""

    DONE_TAG = 7301          # point to point on the barrier's own communicator

    POLL_S = 1e-3
    # Entering, a rank tests this long: the last one in would otherwise find the barrier not
    # yet complete (the others' answers are in flight) and take one more of its slow steps,
    # the others waiting (2 of 3 runs of the x4 rank took 11 profiling steps instead of 10).
    GRACE_S = 0.02

    def __init__(self, comm, min_steps: int = 3):
        self.comm, self.request, self.passed = comm, None, False
        self.min_steps = min_steps
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.others = [r for r in range(self.size) if r != self.rank]
        self.heard = False       # has another rank finished its profiling steps?
        self.sent = []

    def enough(self, steps: int, wanted: int) -> bool:
        """Has this rank profiled enough with `steps` of its `wanted`? All of them, or
        `min_steps` once another rank has finished its own."""
        if steps >= wanted:
            return True
        if steps < self.min_steps:
            return False
        if not self.heard:
            self.heard = any(self.comm.Iprobe(source=r, tag=self.DONE_TAG) for r in self.others)
        return self.heard

    def arrived(self) -> bool:
        """Enter (the first time); True once every rank has entered."""
        if self.request is None:
            self.sent = [self.comm.isend(None, dest=r, tag=self.DONE_TAG) for r in self.others]
            self.request = self.comm.Ibarrier()
            deadline = time.monotonic() + self.GRACE_S
            while not self._test() and time.monotonic() < deadline:
                time.sleep(self.POLL_S / 4)
        return self._test()

    def _test(self) -> bool:
        if not self.passed:
            self.passed = bool(self.request.test()[0])
            if self.passed:     # every rank has entered, so every one has sent its word
                for r in self.others:
                    self.comm.recv(source=r, tag=self.DONE_TAG)
                for request in self.sent:
                    request.wait()
        return self.passed

    def wait(self) -> None:
        """Enter if not yet, and wait for every rank (polled: Open MPI's blocking waits spin
        a core)."""
        while not self.arrived():
            time.sleep(self.POLL_S)


class StepClock:
    """Compute seconds per local step: from the end of one step() to the end of the next,
    less the communication inside it (so forward, backward and data loading all count)."""

    def __init__(self):
        self.last_end = time.perf_counter()
        self.round_compute = 0.0
        self.round_steps = 0
        self.total_compute = 0.0
        self.comm_s = 0.0

    def restart(self) -> None:
        """At the first step() and when a pass over the data begins: whatever came before
        (imports, broadcasts, an evaluation, waiting for the other ranks) is not compute, and
        an emulated slowdown must not stretch it."""
        self.last_end = time.perf_counter()

    def step_done(self, slowdown: Optional[ComputeSlowdown] = None) -> float:
        """The step that just ended; an emulated slowdown stretches it first."""
        if slowdown is not None and slowdown.active:
            slowdown.stretch(self.last_end)
        now = time.perf_counter()
        dt = now - self.last_end
        self.last_end = now
        self.round_compute += dt
        self.round_steps += 1
        self.total_compute += dt
        return dt

    def exclude(self, seconds: float) -> None:
        """Time spent communicating inside step(): not compute."""
        self.last_end += seconds
        self.comm_s += seconds

    def pause(self, seconds: float) -> None:
        """Time that is neither compute nor communication (an evaluation)."""
        self.last_end += seconds

    def round_mean(self) -> Optional[float]:
        return self.round_compute / self.round_steps if self.round_steps else None

    def new_round(self) -> None:
        self.round_compute, self.round_steps = 0.0, 0


class Evaluations:
    """The user's ``evaluate`` callback on the control rank, at most every ``every_s``.

    The callback returns the accuracy, or a ``concurrent.futures.Future`` of it: an
    evaluation run in the background (``ashl.torch.BackgroundEvaluator``) while the rank
    trains on. One evaluation is in flight at most. ``spent_s`` counts only the time the
    rank was held (the whole evaluation, or the snapshot that starts a background one)."""

    def __init__(self, evaluate: Optional[Callable[[], object]], every_s: float):
        if not (isinstance(every_s, (int, float)) and not isinstance(every_s, bool)
                and math.isfinite(every_s) and every_s >= 0):
            raise ValueError(f"eval_every_s must be a number >= 0, got {every_s!r}")
        self.evaluate, self.every_s = evaluate, float(every_s)
        self.last_at = float("-inf")
        self.last_accuracy: Optional[float] = None
        self.spent_s = 0.0
        self.pending = None          # the Future of the evaluation in flight
        self.saved = None            # what start()'s `save` returned for the one taken last
        self._pending_saved = None
        self.closed = False          # finish() has begun: no evaluation starts

    def maybe(self) -> Optional[float]:
        """The accuracy of the model this rank holds now, if an evaluation is due (waiting
        for it if it runs in the background)."""
        self.start()
        return self.take(wait=True)

    def due(self) -> bool:
        """An evaluation would start now: there is a callback, none is in flight, and
        ``every_s`` has passed since the last one started."""
        return (self.evaluate is not None and not self.closed and self.pending is None
                and time.monotonic() - self.last_at >= self.every_s)

    def start(self, save: Optional[Callable[[], object]] = None) -> bool:
        """Start an evaluation of the model held now if one is due and none is in flight.
        For one that runs in the background, `save()` keeps what the strategy needs if its
        result ends the run (one returned at once is taken while that model is still held)."""
        if not self.due():
            return False
        self.last_at = time.monotonic()
        t0 = time.perf_counter()
        result = self.evaluate()
        background = isinstance(result, Future)
        self._pending_saved = save() if background and save is not None else None
        self.spent_s += time.perf_counter() - t0
        if result is None:             # an evaluator that has been closed: none started
            return False
        self.pending = result if background else _done(result)
        return True

    def take(self, wait: bool) -> Optional[float]:
        """The accuracy of the evaluation in flight once it is done (`wait`: wait for it)."""
        if self.pending is None or not (wait or self.pending.done()):
            return None
        t0 = time.perf_counter()
        pending, self.pending = self.pending, None
        try:
            accuracy = pending.result()
        finally:
            self.spent_s += time.perf_counter() - t0   # any wait for it held the rank
        self.saved, self._pending_saved = self._pending_saved, None
        self.last_accuracy = float(accuracy)
        return self.last_accuracy


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def loss_value(loss) -> Optional[float]:
    if loss is None:
        return None
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


@contextlib.contextmanager
def restored_if_refused(*stateful):
    """A checkpoint refused part-way through its load leaves this process as it was: the
    states loaded before the refusal (an optimizer's, an outer optimizer's) are put back."""
    saved = [(s, copy.deepcopy(s.state_dict())) for s in stateful]
    try:
        yield
    except BaseException:
        for s, state in saved:
            s.load_state_dict(state)
        raise


class Strategy:
    """Counters, timing, evaluation, stage following, the timeline and the end of a run."""

    name = "base"
    single_stage = False      # baselines: one training stage, shown as "TRAIN"
    profiled = False          # ashl, ashl-sync: timed steps first, then the plan's H_i
    accepts_compression = ()  # names of the compressors this strategy can send with
    fault_tolerant = False        # this run survives a lost rank: no collective at the end
    # profiled: after its profile_steps a rank keeps stepping until every rank has taken its
    # own (ProfileBarrier), instead of idling while the slowest profiles (within its epoch,
    # unless profile_within_epoch=False)
    steps_while_others_profile = False
    # The first round (and the plan, collective) ends at the end of the first pass over the
    # data at the latest (_end_of_pass_before_plan); not bsp's, whose every step is a round.
    first_round_within_pass = True

    def __init__(self, model, params, *, comm, sampler=None, heterogeneity=None,
                 evaluate: Optional[Callable[[], float]] = None, eval_every_s: float = 2.0,
                 control_rank: int = 0, stage_config: Optional[StageConfig] = None,
                 profile_steps: int = 10, profile_within_epoch: bool = True):
        self.model = model
        self.names, self.tensors = model_state(model, params)
        self.numel = kernels.flat_numel(self.tensors)
        # the parameters come first in the flat model, then the floating-point buffers
        self.params_numel = kernels.flat_numel(self.tensors[:len(params)])
        self.device = model_device(self.tensors)
        self.staging = WireStaging(self.device)   # a CUDA model's trips to the wire
        self.sampler = sampler
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._check_options(control_rank, profile_steps, profile_within_epoch)
        # the run's last barrier, after every other communicator is freed: ours (whatever
        # the script does with `comm`) and never freed (MPI_Finalize frees it)
        self.world = comm.Dup()
        self.comm = comm.Dup()           # the end's gathers, apart from every exchange
        self.control_rank = control_rank
        self.stage_config = StageConfig() if stage_config is None else stage_config
        self.profile_steps = profile_steps
        self.profile_barrier = ProfileBarrier(self.comm)
        # Can an accuracy target be met? Only the control rank must pass evaluate=.
        self.evaluates = bool(self.comm.bcast(evaluate is not None, root=control_rank))
        self.evaluations = Evaluations(evaluate if self.rank == control_rank else None,
                                       eval_every_s)
        self._init_run_state()
        # Emulated hardware (tests, benchmarks): explicit, else ASHL_EMULATE_* variables.
        self.emulated_from_env = heterogeneity is None
        self.hetero = (heterogeneity if heterogeneity is not None
                       else Heterogeneity.from_env(self.rank))
        self.slowdown = self.hetero.slowdown()
        self._hook_sampler(profile_within_epoch)

    def _check_options(self, control_rank: int, profile_steps, profile_within_epoch) -> None:
        """The constructor's arguments, checked before any collective (alike on every rank)."""
        if getattr(self, "join", None) is None:   # a replacement's sampler is rebound later
            check_sampler(self.sampler, self.rank, self.size)
        if self.profiled and not hasattr(self.sampler, "set_shares") and self.rank == control_rank:
            warnings.warn(
                f"strategy {self.name!r} sizes each rank's data share by its speed, but "
                + ("no sampler= was given" if self.sampler is None else
                   f"sampler= is a {type(self.sampler).__name__}") + ", not an "
                "ashl.HeterogeneousSampler: "
                "every rank reads its own fixed share, so the faster ranks wait for the "
                "slowest at the end of each epoch; pass sampler=ashl.HeterogeneousSampler(...)",
                stacklevel=_callers_level())
        if not 0 <= control_rank < self.size:
            raise ValueError(f"the control rank (server_rank) {control_rank} is not a rank "
                             f"of this {self.size}-rank job")
        if self.profiled and not (isinstance(profile_steps, int) and profile_steps >= 3):
            raise ValueError(f"profile_steps must be an integer >= 3 (one is warm-up), "
                             f"got {profile_steps!r}")
        if not isinstance(profile_within_epoch, bool):
            raise ValueError(f"profile_within_epoch must be True or False, "
                             f"got {profile_within_epoch!r}")

    def _init_run_state(self) -> None:
        """Where the run stands (stage, plan, counters, clocks): its start, on every rank."""
        self.stage = Stage.PROFILE
        self.plan: Optional[Plan] = None
        self.planned = False
        self.finished = False
        self.left_early = False
        self._stop_reason: Optional[str] = None
        self.local_steps = 0             # all local steps of this rank
        self.round_steps = 0             # local steps since this rank last communicated
        self.commits = 0
        self.bytes_sent = 0
        self.rejected = 0
        self.clock = StepClock()
        self.loss = RunningLoss()
        self.host = socket.gethostname()
        self.optimizer = None            # the wrapped optimizer, set by DistributedOptimizer
        self.epoch = 0
        self.started = False
        self.resuming = False      # load_checkpoint ran on this rank (checked on all at start)
        self.epoch_steps = 0       # local steps taken in the epoch `_steps_epoch`
        self._steps_epoch: Optional[int] = None
        self.resumed_at: Optional[dict] = None   # the checkpoint's data position, once loaded
        self._closed = False
        from ..profiler import RankProfiler
        self.profiler = RankProfiler(name=self.host)
        self.timeline = Timeline(self.rank)
        self._round_wall = time.time()

    def _hook_sampler(self, profile_within_epoch: bool) -> None:
        sampler = self.sampler
        if hasattr(sampler, "on_iteration"):
            # An evaluation between epochs, or waiting there for the other ranks, is not a
            # step's compute: the plan would take this rank for a slow one.
            sampler.on_iteration(self.clock.restart)
        # Stepping on while the others profile is safe within a pass: a rank that went on
        # into its next epoch would meet the script's collectives between epochs (an
        # hvd.allreduce of its metrics) while the others are in the plan's. That needs the
        # sampler to say where a pass ends (with another, every rank profiles in lockstep),
        # unless the script says it calls none (profile_within_epoch=False).
        if self.steps_while_others_profile and profile_within_epoch:
            self.steps_while_others_profile = hasattr(sampler, "on_exhausted")
        if profile_within_epoch and self.first_round_within_pass and hasattr(
                sampler, "on_exhausted"):
            sampler.on_exhausted(self._end_of_pass_before_plan)

    # ------------------------------------------------------------ what a strategy supplies
    def local_steps_target(self) -> int:
        """This rank's local steps in the current round: the profiling steps, then the
        plan's H_i of the stage (baselines with a fixed count override this)."""
        if self.stage is Stage.PROFILE:
            return self.profile_steps
        return self.plan.local_steps(self.rank, self.stage)

    def _round_done(self) -> bool:
        if self.stage is Stage.PROFILE and self.steps_while_others_profile:
            return (self.profile_barrier.enough(self.round_steps, self.profile_steps)
                    and self.profile_barrier.arrived())
        return self.round_steps >= self.local_steps_target()

    def _make_plan(self) -> None:
        raise NotImplementedError

    def _exchange(self, final: bool = False) -> None:
        raise NotImplementedError

    def _final_model(self) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        pass

    def _between_steps(self) -> None:
        """After every local step, before the round's end is checked (overlapped commits
        look for their reply here)."""

    def _start(self) -> None:
        """At the first step(): the model as broadcast before training is the start."""

    def machine(self) -> Optional[StageMachine]:
        """The run's stage machine where this rank can read it, else None."""
        return None

    # ------------------------------------------------------------------ what a user reads
    @property
    def stage_label(self) -> str:
        """What ``opt.stage`` shows: the stage's name (baselines: "TRAIN", then "DONE")."""
        if self.single_stage:
            return "DONE" if self.finished or self.stage is Stage.DONE else "TRAIN"
        return self.stage.value

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the run ended, where this rank knows it (None while it runs)."""
        machine = self.machine()
        return self._stop_reason or (machine.stop_reason if machine is not None else None)

    @property
    def global_commits(self) -> Optional[int]:
        """The run's commits over all ranks, where this rank knows them, else None."""
        machine = self.machine()
        return None if machine is None else machine.commits

    @property
    def transitions(self) -> list[dict]:
        """The run's stage changes, where this rank sees the stage machine (the server rank;
        every rank of a synchronous strategy, identically), else []."""
        machine = self.machine()
        return [] if machine is None else [
            {"at_s": t.at_s, "commits": t.commits, "from": t.from_stage.value,
             "to": t.to_stage.value, "reason": t.reason} for t in machine.transitions]

    @property
    def lost_ranks(self) -> list[dict]:
        """The ranks a fault-tolerant run lost (none for a fail-stop one)."""
        return []

    def counters(self) -> dict:
        return {"local_steps": self.local_steps, "commits": self.commits,
                "compute_s": self.clock.total_compute, "comm_s": self.clock.comm_s,
                "eval_s": self.evaluations.spent_s, "bytes_sent": self.bytes_sent,
                "rejected": self.rejected, "stop_reason": self.stop_reason,
                "global_commits": self.global_commits, "left_early": self.left_early,
                "last_accuracy": self.evaluations.last_accuracy,
                "device": str(self.device),
                "staging": {"staged": self.staging.staged, **self.staging.copies},
                "emulation": None if self.slowdown is None else {
                    "factor": self.slowdown.factor, "step_s": self.slowdown.step_s,
                    "steps": self.slowdown.steps, "overruns": self.slowdown.overruns}}

    def set_epoch(self, epoch: int) -> None:
        """The training epoch, reported with commits (as a sampler is told)."""
        self.epoch = int(epoch)

    def current_epoch(self) -> int:
        """The epoch reported with commits: the sampler's, else what set_epoch was told."""
        return int(getattr(self.sampler, "epoch", self.epoch))

    def _count_epoch_step(self) -> None:
        epoch = self.current_epoch()
        if epoch != self._steps_epoch:
            self._steps_epoch, self.epoch_steps = epoch, 0
        self.epoch_steps += 1

    def data_position(self) -> dict:
        """Where this rank is in its data: the epoch and the local steps taken in it (what
        a resumed loop skips to continue where the checkpoint left off)."""
        epoch = self.current_epoch()
        return {"epoch": epoch, "steps_in_epoch": self.epoch_steps
                if epoch == self._steps_epoch else 0}

    # ------------------------------------------------------------------ the driving loop
    def before_step(self) -> None:
        if self.finished:
            raise RuntimeError("this optimizer has finished (opt.finished is True); "
                               "stop the training loop")
        if not self.started:
            self.started = True
            self._round_wall = time.time()
            self.clock.restart()
            self._start()

    def wait_for_device(self) -> None:
        """Block until the kernels queued on this rank's device have run: what is timed on
        the host's clock must have happened, not just been queued."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def after_step(self, loss) -> None:
        # A step is timed on the host's clock (the profile, the round's mean for drift). One
        # wait a step, where the loop's own loss.item() would wait anyway.
        self.wait_for_device()
        dt = self.clock.step_done(self.slowdown)
        self.local_steps += 1
        self.round_steps += 1
        self._count_epoch_step()
        value = loss_value(loss)
        if value is not None and math.isfinite(value):
            self.loss.add(value)
        if self.stage is Stage.PROFILE:
            self.profiler.record("compute", dt)
        self._between_steps()
        if not self.finished and self._round_done():
            self._end_round()

    def _end_round(self) -> None:
        """The plan if there is none yet, then the exchange; neither is a step's compute."""
        t0, evals = time.perf_counter(), self.evaluations.spent_s
        if not self.planned:
            self._plan()
        self._exchange()
        evaluating = self.evaluations.spent_s - evals
        self.clock.exclude(time.perf_counter() - t0 - evaluating)
        self.clock.pause(evaluating)

    def _end_of_pass_before_plan(self) -> None:
        """The sampler's pass is over before the first round ended (an epoch shorter than
        the profile or the first H: a small dataset, a large batch, a rank with one batch):
        the first round ends here, whatever its steps, before the script's code between
        epochs. A rank that went on into its next epoch would meet the script's collectives
        there (an hvd.allreduce of its metrics) while another waits in the plan's or the
        first round's; every rank ends its first round within its first pass instead."""
        if self.planned or self.finished:
            return
        if not self.started:          # a rank whose pass was empty
            self.before_step()
        self._end_round()

    def _plan(self) -> None:
        if not self.profiler.samples["compute"]:
            # no step was timed (an empty first pass, or finish() before a step): the plan
            # still needs every rank's number; the drift re-plan corrects it later
            self.profiler.record("compute", 1e-3)
        if self.steps_while_others_profile:
            # entered by every rank once, even one that stopped before its profiling steps:
            # the collectives of the plan line up
            self.profile_barrier.wait()
        self.planned = True
        self._make_plan()

    # ------------------------------------------------------------------- the control plane
    def adopt_plan(self, plan: Plan) -> None:
        """A plan (the first, or a re-plan): its data shares apply at the sampler's next
        epoch boundary on this rank."""
        self.plan = plan
        self.timeline.instant("plan", version=plan.version,
                              H=plan.local_steps(self.rank, self.stage.planned))
        self._give_shares()

    def _give_shares(self) -> None:
        if self.plan is not None and hasattr(self.sampler, "set_shares"):
            self.sampler.set_shares(list(self.plan.stage(self.stage.planned).shares))

    def _follow_machine(self, machine: StageMachine) -> None:
        """Adopt what a stage machine fed with this round's numbers decided."""
        self._follow(machine.stage, machine.transitions[-1].reason if machine.transitions else None)

    def _follow(self, stage: Stage, reason: Optional[str] = None) -> None:
        """Adopt the run's stage as decided for this round."""
        if stage is self.stage:
            return
        old, self.stage = self.stage, stage
        if stage is Stage.DONE:
            self.finished = True
            self._stop_reason = reason or self._stop_reason
            self.timeline.instant("stop", reason=self.stop_reason)
            log.info("%s: rank %d stops: %s", self.name, self.rank, self.stop_reason)
        else:
            self.timeline.instant("stage", stage=stage.value, reason=reason)
            self.on_stage_change(old, stage)

    def on_stage_change(self, old: Stage, new: Stage) -> None:
        """What a rank does when the run enters a new training stage: its sampler takes
        the new stage's data shares (the plan's H_i, ratio and weights follow from
        ``self.stage`` by themselves)."""
        self._give_shares()

    def round_span(self, start_wall: float, **args) -> None:
        """The timeline's compute span of the round that ended at `start_wall` and the
        exchange span from there to now."""
        now = time.time()
        self.timeline.span("compute", self._round_wall, start_wall, steps=args.pop("steps", 0))
        self.timeline.span("commit", start_wall, now, **args)
        self._round_wall = now

    # ------------------------------------------------------------------------- the end
    def finish(self) -> None:
        """Leave the run (collective, once per rank): tell the others if the run has not
        ended, then every rank ends with the same final model."""
        if self._closed:
            return
        self._closed = True
        self.evaluations.closed = True   # nothing is evaluated for a run that is ending
        if not self.started:
            self.before_step()
        t0 = time.perf_counter()
        if not self.planned:
            # Stopped before the first round ended: plan now so the collective calls line up.
            self._plan()
        if not self.finished:
            self.left_early = True
            self._exchange(final=True)
        self.finished = True
        self.stage = Stage.DONE
        self._final_model()
        self._write_timeline()
        self._close()
        self.comm.Free()
        if not self.fault_tolerant:      # (whose ranks may be gone)
            self._last_barrier()
        self.clock.comm_s += time.perf_counter() - t0

    def _last_barrier(self) -> None:
        """The run's last MPI call, after every communicator of its own is freed. When
        Horovod initialised MPI, the first rank to shut Horovod down at its exit makes every
        rank's Horovod finalise MPI; past this barrier no rank touches MPI again, so none is
        left freeing a communicator of a finalised MPI (a segfault at exit, 1 run in 40).
        Polled while a slow rank closes its ends; then blocking, so that no rank has a test()
        of a completed request still to make when the others leave (microseconds, against
        the milliseconds Horovod takes to agree on its shutdown)."""
        wait_polled(self.world.Ibarrier(), ProfileBarrier.POLL_S)
        self.world.Barrier()

    def _write_timeline(self) -> None:
        path = timeline_path()   # every rank agrees on it: the gather is collective
        if path and self.fault_tolerant:   # no collective: each rank its own file
            events = [[]] * self.rank + [self.timeline.events]
            write_chrome_trace(f"{path.removesuffix('.json')}.rank{self.rank}.json", events)
        elif path:
            traces = self.comm.gather(self.timeline.events, root=self.control_rank)
            if self.rank == self.control_rank:
                write_chrome_trace(path, traces)

    # ------------------------------------------------------------------- checkpoints
    def check_every_rank_resumes(self) -> None:
        """Collective, at the start: a checkpoint loaded on some ranks only (Horovod's recipe
        loads on rank 0 and broadcasts) would leave the others with their own counters and
        state, or waiting in a resume's barrier for ever: refuse it on every rank instead."""
        resuming = self.comm.allgather(self.resuming)
        if any(resuming) and not all(resuming):
            loaded = [r for r, x in enumerate(resuming) if x]
            raise ValueError(f"load_checkpoint was called on rank(s) {loaded} only, of "
                             f"{self.size}: call it on every rank (each rank's file holds its "
                             "own optimizer state), not on rank 0 alone as with Horovod's "
                             "load-then-broadcast recipe")

    def _sampler_keeps_schedule(self) -> bool:
        """A HeterogeneousSampler: its shares schedule travels with a checkpoint."""
        s = self.sampler
        return all(hasattr(s, a) for a in ("set_shares", "state_dict", "load_state_dict"))

    def _save_own(self, path: str, optimizer, **extra) -> None:
        """This rank's part of a checkpoint: its optimizer state, counters, position and its
        HeterogeneousSampler's shares schedule."""
        position = self.data_position()
        if self._sampler_keeps_schedule():
            extra["sampler"] = self.sampler.state_dict()
        checkpoint.save_rank(path, self.rank, optimizer, self.counters(), position["epoch"],
                             steps_in_epoch=position["steps_in_epoch"], **extra)

    def _load_own(self, path: str, optimizer, restore_sampler: bool = True,
                  tensors: Optional[dict] = None) -> dict:
        """This rank's part: its optimizer state, counters, position and (`restore_sampler`)
        shares schedule back, before the loop's first pass: the resumed epoch reads with the
        counts its skipped batches were counted in, as the saved run did; and the saved
        tensors named in `tensors` copied into them. A part that does not fit changes
        nothing. Returns the file."""
        tensors = tensors or {}
        own_path = checkpoint.rank_path(path, self.rank)
        own = checkpoint.load(own_path)
        try:
            counters = own.get("counters", {})
            steps, commits = int(counters.get("local_steps", 0)), int(counters.get("commits", 0))
            epoch, in_epoch = int(own.get("epoch", 0)), int(own.get("steps_in_epoch", 0))
            saved = {k: own[k] for k in tensors if own.get(k) is not None}
            for name, t in saved.items():
                if not isinstance(t, torch.Tensor) or t.shape != tensors[name].shape:
                    raise ValueError(f"its {name} is not a tensor of shape "
                                     f"{tuple(tensors[name].shape)}")
            with restored_if_refused(optimizer):
                optimizer.load_state_dict(own["optimizer"])
                if restore_sampler and own.get("sampler") is not None \
                        and self._sampler_keeps_schedule():     # the last that may refuse:
                    self.sampler.load_state_dict(own["sampler"])    # checks, then assigns
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"checkpoint {own_path} does not fit this run: {e}") from None
        for name, t in saved.items():
            tensors[name].copy_(t)
        self.local_steps, self.commits = steps, commits
        self.epoch = self._steps_epoch = epoch
        self.epoch_steps = in_epoch
        self.resumed_at = {"epoch": self.epoch, "steps_in_epoch": self.epoch_steps}
        self.resuming = True
        return own

    def save_checkpoint(self, path: str, optimizer) -> None:
        raise NotImplementedError(f"strategy {self.name!r} does not checkpoint; use a strategy "
                                  "that does (ashl, localsgd, diloco, async-localsgd, ...), or "
                                  "save the model and optimizer state_dict as with plain Horovod")

    def load_checkpoint(self, path: str, optimizer) -> None:
        raise NotImplementedError(f"strategy {self.name!r} does not checkpoint; use a strategy "
                                  "that does (ashl, localsgd, diloco, async-localsgd, ...), or "
                                  "load the model and optimizer state_dict as with plain Horovod")

    # ---------------------------------------------------------------- shared mechanics
    def clear_optimizer_state(self) -> None:
        """Forget the optimizer's state (momentum), as for a fresh start of training."""
        state = getattr(self.optimizer, "state", None)
        if state is not None:
            state.clear()

    def clear_nonfinite_optimizer_state(self) -> int:
        """After a rejected (NaN/Inf) delta the parameters come back from the global model,
        but momentum and similar buffers would re-poison them: zero every optimizer state
        tensor that holds a non-finite value. Returns how many were cleared."""
        cleared = 0
        for state in getattr(self.optimizer, "state", {}).values():
            for value in state.values():
                if (isinstance(value, torch.Tensor) and value.is_floating_point()
                        and not bool(torch.isfinite(value).all())):
                    value.zero_()
                    cleared += 1
        return cleared

    def measured_profile(self, mc, payload_bytes: int, compress: Sequence[float] = ()):
        """This rank's profile (collective): its timed steps, its link measured for a real
        message of `payload_bytes` (a probe of it over 1 MiB, extrapolated) plus any emulated
        link delay, and `compress` (timed compressions, the first a warm-up) when it has any."""
        push, pull = mc.measure_link(payload_bytes)
        emulated = self.hetero.link_delay(payload_bytes)
        self.profiler.extend("push", [push.mean + emulated])
        self.profiler.extend("pull", [pull.mean + emulated])
        self.profiler.extend("compress", compress)
        return self.profiler.profile(min_warmup=1)

    def flat_model(self, tensors=None) -> torch.Tensor:
        """A flat fp32 copy of `tensors` (default: the model's state)."""
        tensors = self.tensors if tensors is None else tensors
        flat = torch.empty(self.numel, dtype=torch.float32, device=tensors[0].device)
        kernels.pack_delta(tensors, [torch.zeros_like(t) for t in tensors], flat)
        return flat
