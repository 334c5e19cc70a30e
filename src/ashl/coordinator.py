"""Rank 0's brain and its thin MPI edge.

`Coordinator` is pure (no MPI): it makes the first plan from the gathered profiles, takes
one `CommitReport` per commit and answers with a `Directive` (plan version, stage, stop
flag, and the new plan when the rank's copy is stale). It re-plans when a rank's measured
speed drifts from what the plan assumed, and it owns the StageMachine.

`MPICoordinator` is the MPI edge at start-up, on a duplicate of COMM_WORLD: measure each
rank's link, gather profiles, broadcast the plan. At run time nothing travels through it:
the parameter server calls `Coordinator.on_commit` for each commit it receives and
piggy-backs the directive on its reply (server.py).

Drift rule (docs/PLANNER.md): per rank, the median of its last `window` reports is
compared with the plan's assumption. A re-plan happens when some rank is off by more than
`threshold` (default 20 %) and the error moves its round by more than `min_round_change`
of the round; at most once per `cooldown_commits`. At a re-plan only ranks off by more
than `release` (10 %) get new numbers; the others keep theirs (hysteresis: noise just
under the trigger does not move the plan).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from .planner import (Plan, PlannerConfig, RankProfile, embed_plan, make_plan, pull_seconds,
                      push_seconds)
from .profiler import RoundTrips, measure_round_trip, summarize
from .stages import Stage, StageConfig, StageMachine

__all__ = ["CommitReport", "Directive", "DriftConfig", "CoordinatorEvent", "Coordinator",
           "MPICoordinator", "wait_polled"]

log = logging.getLogger("ashl.coordinator")


def positive_seconds(value: Any) -> bool:
    """A number of seconds > 0 (not a bool, not NaN or infinite)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


@dataclass(frozen=True)
class CommitReport:
    """What a rank tells rank 0 at a commit.

    step_s   mean compute seconds per local step in the round just finished
    link_s   wall seconds of this rank's previous commit exchange (push + pull; in SHL it
             includes any time the server held the reply back for the staleness bound);
             None if unknown
    link_ratio  compression ratio that exchange used (1.0 = dense)
    loss     the rank's running training loss (stages.RunningLoss)
    """

    rank: int
    plan_version: int
    step_s: float | None = None
    link_s: float | None = None
    link_ratio: float = 1.0
    loss: float | None = None
    samples: int = 0
    local_steps: int = 0
    epoch: int = 0


@dataclass(frozen=True)
class Directive:
    """Rank 0's answer to a commit."""

    plan_version: int
    stage: Stage
    stop: bool
    reason: str = ""
    plan: Plan | None = None     # set when the reporting rank's plan is out of date
    shares_epoch: int = 0        # the epoch from which the data shares of the run's current
                                 # plan and stage apply, on every rank


@dataclass(frozen=True)
class DriftConfig:
    enabled: bool = True
    threshold: float = 0.2          # re-plan when a rank is off by more than this fraction
    release: float = 0.1            # at a re-plan, refresh every rank off by more than this
    window: int = 5                 # reports per rank in the median
    min_reports: int = 3            # reports needed before a rank's estimate counts
    min_round_change: float = 0.05  # ignore errors that move the rank's round by less than this
    cooldown_commits: int | None = None  # commits (all ranks) between re-plans; None = 2 * n_ranks
    cooldown_s: float = 1.0         # and at least this long: re-planning faster than ranks can
                                    # measure only chases noise

    def __post_init__(self) -> None:
        if not 0 < self.release <= self.threshold:
            raise ValueError(f"drift config: need 0 < release <= threshold, got "
                             f"release={self.release!r}, threshold={self.threshold!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"drift config: window must be an integer >= 1, got {self.window!r}")
        if not isinstance(self.min_reports, int) or not 1 <= self.min_reports <= self.window:
            raise ValueError(f"drift config: min_reports must be in [1, window], got {self.min_reports!r}")
        if self.min_round_change < 0:
            raise ValueError(f"drift config: min_round_change must be >= 0, got {self.min_round_change!r}")
        if not (isinstance(self.cooldown_s, (int, float)) and self.cooldown_s >= 0):
            raise ValueError(f"drift config: cooldown_s must be >= 0, got {self.cooldown_s!r}")
        if self.cooldown_commits is not None and self.cooldown_commits < 0:
            raise ValueError(f"drift config: cooldown_commits must be >= 0, got {self.cooldown_commits!r}")


@dataclass(frozen=True)
class CoordinatorEvent:
    """One line of the plan/stage log."""

    at_s: float
    kind: str            # "plan" | "stage" | "stop"
    plan_version: int
    stage: str
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Drift:
    rank: int
    what: str            # "compute" | "link"
    estimate: float      # compute: seconds per step; link: factor over the plan's prediction
    relative: float      # estimate vs assumption, signed
    significant: bool    # also moves the round enough to matter


class Coordinator:
    """Pure coordinator state machine used on rank 0."""

    def __init__(self, n_ranks: int, planner_config: PlannerConfig | None = None,
                 stage_config: StageConfig | None = None, drift_config: DriftConfig | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.n_ranks = n_ranks
        self.planner_config = planner_config or PlannerConfig()
        self.drift_config = drift_config or DriftConfig()
        self.clock = clock
        self.machine = StageMachine(n_ranks, stage_config, start_time=clock())
        self.plan: Plan | None = None
        self.events: list[CoordinatorEvent] = []
        w = self.drift_config.window
        self._steps = [deque(maxlen=w) for _ in range(n_ranks)]
        self._links = [deque(maxlen=w) for _ in range(n_ranks)]   # (seconds, ratio)
        self._replanned_at = 0
        self._replanned_time = float("-inf")
        self._seen_transitions = 0
        self.live = set(range(n_ranks))
        # Data shares change with the plan and the stage, but the ranks hear of a change at
        # different moments and in different epochs: every rank takes new shares from one
        # epoch that none has begun yet, so each epoch stays one permutation of the data.
        self._epochs: dict[int, int] = {}     # each rank's last reported epoch
        self._epoch_lead = 0                  # most epochs a rank began between two reports
        self.shares_epoch = 0
        # How a strategy plans a subset of its ranks (the survivors of a lost rank); the
        # default is make_plan with this coordinator's planner config.
        self.plan_for: Callable[[Sequence[RankProfile]], Plan] = (
            lambda profiles: make_plan(profiles, self.planner_config))

    # --------------------------------------------------------------- state
    @property
    def stage(self) -> Stage:
        return self.machine.stage

    @property
    def global_loss(self) -> float | None:
        return self.machine.global_loss

    def _now_s(self) -> float:
        return self.clock() - self.machine.start_time

    def _log(self, kind: str, reason: str) -> None:
        event = CoordinatorEvent(at_s=self._now_s(), kind=kind,
                                 plan_version=self.plan.version if self.plan else 0,
                                 stage=self.stage.value, reason=reason)
        self.events.append(event)
        log.info("%s: plan v%d, stage %s (%s)", kind, event.plan_version, event.stage, reason)

    def note_epochs(self, epochs: Sequence[int]) -> None:
        """Every rank's epoch, all at once (a collective: none is moving): new shares apply
        from the next one."""
        self._epochs = {r: int(e) for r, e in enumerate(epochs)}
        self.shares_epoch = max(self._epochs.values(), default=0) + 1

    def _note_epoch(self, rank: int, epoch: int) -> None:
        last = self._epochs.get(rank)
        if last is not None and epoch > last:
            self._epoch_lead = max(self._epoch_lead, epoch - last)
        self._epochs[rank] = epoch if last is None else max(epoch, last)

    def _restamp_shares(self) -> None:
        """New shares: from past the furthest epoch a rank may have begun before it hears.
        It hears with the reply to its next commit, which (overlapped) lands during the
        round after: two rounds past its last report, each at most `_epoch_lead` epochs."""
        self.shares_epoch = max(self._epochs.values(), default=0) + 2 * self._epoch_lead + 1

    def _sync_stage(self) -> None:
        """Log new transitions and point the global-loss weights at the current stage."""
        for t in self.machine.transitions[self._seen_transitions:]:
            kind = "stop" if t.to_stage is Stage.DONE else "stage"
            if t.to_stage.training:
                self._restamp_shares()
            self._log(kind, f"{t.from_stage.value} -> {t.to_stage.value}: {t.reason}")
        self._seen_transitions = len(self.machine.transitions)
        if self.plan is not None and self.stage.training:
            self.machine.set_weights(self.plan.stage(self.stage).shares)

    def directive(self, rank_plan_version: int | None = None) -> Directive:
        version = self.plan.version if self.plan else 0
        return Directive(plan_version=version, stage=self.stage, stop=self.machine.done,
                         reason=self.machine.stop_reason or "", shares_epoch=self.shares_epoch,
                         plan=self.plan if self.plan is not None and rank_plan_version != version else None)

    # -------------------------------------------------------------- events
    def plan_from_profiles(self, profiles: Sequence[RankProfile]) -> Plan:
        """The first plan; moves the run from PROFILE to AHL."""
        if len(profiles) != self.n_ranks:
            raise ValueError(f"expected {self.n_ranks} profiles (one per rank), got {len(profiles)}")
        self.plan = make_plan(profiles, self.planner_config, version=1,
                              reason="initial plan from profiling")
        self._log("plan", self.plan.reason)
        self.machine.begin_training(self.clock())
        self._sync_stage()
        return self.plan

    def resume(self, plan: Plan, stage: Stage) -> None:
        """Continue a checkpointed run with its plan, in its stage (no profiling)."""
        if len(plan.profiles) != self.n_ranks:
            raise ValueError(f"the checkpoint's plan is for {len(plan.profiles)} ranks, "
                             f"this job has {self.n_ranks}")
        self.plan = plan
        self._log("plan", f"resumed from a checkpoint (plan v{plan.version})")
        self.machine.resume(stage, self.clock())
        self._sync_stage()

    def start(self, plan: Plan, stage: Stage, reason: str) -> None:
        """Begin training in ``stage`` with a plan made without profiling (a baseline's
        fixed plan); PROFILE -> ``stage`` at once."""
        if len(plan.profiles) != self.n_ranks:
            raise ValueError(f"the plan is for {len(plan.profiles)} ranks, this job has {self.n_ranks}")
        self.plan = plan
        self._log("plan", reason)
        self.machine.resume(stage, self.clock(), reason=reason)
        self._sync_stage()

    def on_commit(self, report: CommitReport) -> Directive:
        if self.plan is None:
            raise RuntimeError("commit reported before the first plan was made")
        if not isinstance(report.rank, int) or not 0 <= report.rank < self.n_ranks:
            raise ValueError(f"report from rank {report.rank!r}, but there are {self.n_ranks} ranks")
        r = report.rank
        if positive_seconds(report.step_s):
            self._steps[r].append(float(report.step_s))
        if positive_seconds(report.link_s) and positive_seconds(report.link_ratio):
            self._links[r].append((float(report.link_s), float(report.link_ratio)))
        self._note_epoch(r, int(report.epoch))
        loss = report.loss if report.loss is not None and math.isfinite(report.loss) else None
        self.machine.commit(r, self.clock(), loss)
        self._sync_stage()
        if not self.machine.done:
            self._maybe_replan()
        return self.directive(report.plan_version)

    def lose(self, rank: int, reason: str) -> None:
        """A rank is gone: re-plan among the survivors (their shares, H and merge weights;
        the lost rank gets none)."""
        if rank not in self.live:
            return
        self.live.discard(rank)
        self._steps[rank].clear()
        self._links[rank].clear()
        if self.plan is None or not self.live:
            return
        self.plan = self._plan_live(self.plan.profiles, self.plan.version + 1, reason)
        self._sync_stage()
        self._log("plan", reason)

    def rejoin(self, rank: int, compute_s: float, reason: str) -> None:
        """A replacement took lost `rank`'s slot: re-plan with it, from its measured compute
        time and the slot's link (its commit reports correct that, as drift)."""
        if self.plan is None or not 0 <= rank < self.n_ranks or rank in self.live:
            raise ValueError(f"rank {rank} is not a lost rank of a planned run")
        if not positive_seconds(compute_s):
            raise ValueError(f"compute_s must be a number of seconds > 0, got {compute_s!r}")
        profiles = list(self.plan.profiles)
        profiles[rank] = profiles[rank].with_compute(compute_s)
        self.live.add(rank)
        self.plan = self._plan_live(profiles, self.plan.version + 1, reason)
        self._sync_stage()
        self._log("plan", reason)

    def _plan_live(self, profiles: Sequence[RankProfile], version: int, reason: str) -> Plan:
        """A re-plan of the live ranks (its shares, from a new shares epoch)."""
        self._restamp_shares()
        live = sorted(self.live)
        sub = self.plan_for([profiles[r] for r in live])
        return embed_plan(sub, live, profiles, version=version, reason=reason)

    def on_evaluation(self, loss: float | None = None, accuracy: float | None = None) -> Stage:
        self.machine.evaluation(self.clock(), loss=loss, accuracy=accuracy)
        self._sync_stage()
        return self.stage

    def tick(self) -> Stage:
        self.machine.tick(self.clock())
        self._sync_stage()
        return self.stage

    def stop(self, reason: str) -> Stage:
        self.machine.stop(self.clock(), reason)
        self._sync_stage()
        return self.stage

    # ------------------------------------------------------------------ drift
    def drifts(self) -> list[_Drift]:
        """Each rank's current deviation from the plan (ranks with enough reports)."""
        cfg, plan = self.drift_config, self.plan
        stage = plan.stage(self.stage.planned)
        out = []
        for r in sorted(self.live):
            p = plan.profiles[r]
            h = stage.local_steps[r]
            if len(self._steps[r]) >= cfg.min_reports:
                est = statistics.median(self._steps[r])
                rel = est / p.compute_s - 1
                moved = abs(est - p.compute_s) * h
                out.append(_Drift(r, "compute", est, rel,
                                  abs(rel) > cfg.threshold and moved > cfg.min_round_change * stage.round_s))
            if len(self._links[r]) >= cfg.min_reports:
                factors = [s / (push_seconds(p, ratio, plan.config) + pull_seconds(p, plan.config))
                           for s, ratio in self._links[r]]
                est = statistics.median(factors)
                planned_link = push_seconds(p, stage.ratios[r], plan.config) + pull_seconds(p, plan.config)
                moved = abs(est - 1) * planned_link
                out.append(_Drift(r, "link", est, est - 1,
                                  abs(est - 1) > cfg.threshold and moved > cfg.min_round_change * stage.round_s))
        return out

    def _maybe_replan(self) -> None:
        cfg = self.drift_config
        if not cfg.enabled:
            return
        cooldown = 2 * self.n_ranks if cfg.cooldown_commits is None else cfg.cooldown_commits
        if self.plan.version > 1 and (self.machine.commits - self._replanned_at < cooldown
                                      or self.clock() - self._replanned_time < cfg.cooldown_s):
            return
        drifts = self.drifts()
        triggers = [d for d in drifts if d.significant]
        if not triggers:
            return
        profiles = list(self.plan.profiles)
        changed = []
        for d in drifts:
            if abs(d.relative) <= cfg.release:
                continue
            if d.what == "compute":
                profiles[d.rank] = profiles[d.rank].with_compute(d.estimate)
            else:
                profiles[d.rank] = profiles[d.rank].with_link_scaled(d.estimate)
            changed.append(f"rank {d.rank} {d.what} {d.relative:+.0%}")
        reason = ("drift: " + ", ".join(f"rank {d.rank} {d.what} {d.relative:+.0%}" for d in triggers)
                  + "; refreshed " + ", ".join(changed))
        self.plan = self._plan_live(profiles, self.plan.version + 1, reason)
        self._replanned_at = self.machine.commits
        self._replanned_time = self.clock()
        # Hysteresis: a refreshed rank's estimate is now the plan; judge it again only on
        # reports made under the new plan.
        for d in drifts:
            if abs(d.relative) > cfg.release:
                (self._steps if d.what == "compute" else self._links)[d.rank].clear()
        self._sync_stage()
        self._log("plan", reason)


# ------------------------------------------------------------------------- MPI

def wait_polled(request: Any, poll_s: float = 5e-4) -> Any:
    """Wait for an MPI request by testing it: Open MPI's blocking waits spin a core."""
    while True:
        done, value = request.test()
        if done:
            return value
        time.sleep(poll_s)


_LINK_GO, _LINK_PUSH, _LINK_ACK, _LINK_REQ, _LINK_PULL = 7111, 7112, 7113, 7114, 7115
_MORE, _PROBE = 1, 2    # a link request's bits: another exchange follows; this pull is the probe


class MPICoordinator:
    """The coordinator's start-up over mpi4py. Every rank constructs one (collective).

    Typical use on every rank:
        mc = MPICoordinator()
        push, pull = mc.measure_link(payload_bytes)           # collective
        plan = mc.establish_plan(profile)                      # collective; all ranks equal
        ... the server feeds mc.coordinator (root) under mc.lock
        mc.close()                                             # collective
    """

    def __init__(self, comm: Any = None, root: int = 0, *, planner_config: PlannerConfig | None = None,
                 stage_config: StageConfig | None = None, drift_config: DriftConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 5e-4):
        if comm is None:
            from mpi4py import MPI   # importing it initialises MPI: only when asked to
            comm = MPI.COMM_WORLD
        base = comm
        self.comm = base.Dup()        # our own tag space, separate from the server's traffic
        self.rank, self.size, self.root = self.comm.Get_rank(), self.comm.Get_size(), root
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} out of range for {self.size} ranks")
        self.poll_s = poll_s
        self.coordinator = (Coordinator(self.size, planner_config, stage_config, drift_config, clock)
                            if self.rank == root else None)
        self.plan: Plan | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.shares_epoch: int | None = None    # the first plan's, once broadcast

    @property
    def is_root(self) -> bool:
        return self.rank == self.root

    @property
    def lock(self) -> threading.Lock:
        """Held while the root's Coordinator changes; shared with the server feeding it."""
        return self._lock

    # ---------------------------------------------------------------- helpers
    def _wait(self, request: Any) -> Any:
        return wait_polled(request, self.poll_s)

    def _poll_recv(self, source: int, tag: int) -> Any:
        while not self.comm.Iprobe(source=source, tag=tag):
            time.sleep(self.poll_s)
        return self.comm.recv(source=source, tag=tag)

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier())

    # -------------------------------------------------------------- profiling
    def measure_link(self, payload_bytes: int, trips: RoundTrips | None = None):
        """Round-trip push and pull of a `payload_bytes` message to the root (collective).

        Returns (push, pull) TimingSummary. Ranks are served one at a time so they do
        not compete, each for as many round trips as its `trips` allow (the root follows
        each rank's requests). A payload larger than the probe is timed as the probe and
        extrapolated (RoundTrips). The root's probe size is the one every rank times: the
        root sends it with its go-ahead, so ranks that pass another payload or probe size
        still agree with it on every message's size. The root measures a message to itself
        (its server is a thread there).
        """
        trips = trips or RoundTrips()
        size = max(1, int(payload_bytes))
        if self.is_root:
            probe = bytearray(trips.probe_size(size))
            push, pull, latency = self._time_copy(probe, trips, trips.latency_trips(size))
            push_latency = pull_latency = latency
            for r in range(self.size):
                if r != self.root:
                    self._serve_link(r, probe)
        else:
            probe = bytearray(self._poll_recv(self.root, _LINK_GO))
            latency_trips = trips.latency_trips(size, probe_bytes=len(probe))
            push, pull, push_latency, pull_latency = self._time_link(probe, trips, latency_trips)
        self.barrier()
        scale = size / len(probe)
        return push.extrapolated(push_latency, scale), pull.extrapolated(pull_latency, scale)

    def _time_copy(self, probe: bytearray, trips: RoundTrips, latency_trips: int):
        """The root's push and pull: an MPI message to itself, a memory copy as its own
        commits are; and the least time of a one-byte one as the latency."""
        sink = bytearray(len(probe))

        def copy(message: bytearray) -> None:
            request = self.comm.Irecv(sink, source=self.rank, tag=_LINK_PUSH)
            self.comm.Send(message, dest=self.rank, tag=_LINK_PUSH)
            request.Wait()

        push = measure_round_trip(lambda: copy(probe), trips)
        pull = measure_round_trip(lambda: copy(probe), trips)
        latency = 0.0
        if latency_trips:
            one = bytearray(1)
            latency = measure_round_trip(lambda: copy(one), RoundTrips(
                repeats=latency_trips, warmup=0, min_repeats=latency_trips,
                budget_s=0.0)).minimum
        return push, pull, latency

    def _serve_link(self, rank: int, probe: bytearray) -> None:
        """The root's side of `rank`'s round trips, each as the rank's request says: a pull
        of one byte or of the probe, and whether another exchange follows."""
        one, request = bytearray(1), bytearray([_MORE])
        self.comm.send(len(probe), dest=rank, tag=_LINK_GO)   # the size the rank times
        while request[0] & _MORE:
            self.comm.Recv(probe, source=rank, tag=_LINK_PUSH)
            self.comm.Send(one, dest=rank, tag=_LINK_ACK)
            self.comm.Recv(request, source=rank, tag=_LINK_REQ)
            self.comm.Send(probe if request[0] & _PROBE else one, dest=rank, tag=_LINK_PULL)

    def _time_link(self, probe: bytearray, trips: RoundTrips, latency_trips: int):
        """A rank's push and pull times, and its push and pull latency (0 when not timed).

        The warm-ups carry one byte each way: they set up the connection, and a slow link's
        probe would take a second more. The next `latency_trips` carry one byte as well and
        are timed as the latency; the rest carry the probe, until `trips` has enough."""
        one = bytearray(1)
        start = time.perf_counter()
        for _ in range(trips.warmup):
            self._push(one)
            self._pull(one, _MORE)
        latency = [(self._push(one), self._pull(one, _MORE)) for _ in range(latency_trips)]
        pushes, pulls = [], []
        while True:
            pushes.append(self._push(probe))
            more = not trips.enough(trips.warmup + len(pushes), time.perf_counter() - start)
            pulls.append(self._pull(probe, _PROBE | (_MORE if more else 0)))
            if not more:
                break
        return (summarize(pushes, min_warmup=0), summarize(pulls, min_warmup=0),
                min((push for push, _ in latency), default=0.0),
                min((pull for _, pull in latency), default=0.0))

    def _push(self, message: bytearray) -> float:
        """Send `message` to the root and wait for its one-byte acknowledgement: seconds."""
        t0 = time.perf_counter()
        self.comm.Send(message, dest=self.root, tag=_LINK_PUSH)
        self.comm.Recv(bytearray(1), source=self.root, tag=_LINK_ACK)
        return time.perf_counter() - t0

    def _pull(self, into: bytearray, request: int) -> float:
        """Send the root a one-byte `request` (what the pull carries, whether another
        exchange follows) and receive its answer `into`: seconds."""
        t0 = time.perf_counter()
        self.comm.Send(bytearray([request]), dest=self.root, tag=_LINK_REQ)
        self.comm.Recv(into, source=self.root, tag=_LINK_PULL)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ plans
    def gather_profiles(self, profile: RankProfile, epoch: int = 0) -> list[RankProfile] | None:
        """All ranks' profiles on the root (index = rank), and their epochs to the
        coordinator; None elsewhere."""
        self.barrier()       # wait politely for the slowest rank; the gather itself is then quick
        gathered = self.comm.gather((profile.to_dict(), int(epoch)), root=self.root)
        if not self.is_root:
            return None
        with self._lock:
            self.coordinator.note_epochs([e for _, e in gathered])
        return [RankProfile.from_dict(d, where=f"rank {i}") for i, (d, _) in enumerate(gathered)]

    def broadcast_plan(self, plan: Plan | None = None) -> Plan:
        """The root's plan on every rank (each rank parses the same JSON), and the epoch its
        data shares apply from (`shares_epoch`)."""
        sent = (plan.to_json(), self.coordinator.shares_epoch) if self.is_root else None
        text, self.shares_epoch = self.comm.bcast(sent, root=self.root)
        self.plan = Plan.from_json(text)
        return self.plan

    def establish_plan(self, profile: RankProfile, epoch: int = 0) -> Plan:
        """Gather profiles, plan on the root, broadcast (collective; all ranks equal)."""
        profiles = self.gather_profiles(profile, epoch)
        plan = None
        if self.is_root:
            with self._lock:
                plan = self.coordinator.plan_from_profiles(profiles)
        return self.broadcast_plan(plan)

    def close(self, collective: bool = True) -> None:
        """Wait for every rank (unless not `collective`: a fault-tolerant run's ranks may be
        gone), then free the communicator."""
        if self._closed:
            return
        self._closed = True
        if collective:
            self.barrier()
        self.comm.Free()
