"""Every rank starts one run: the options that shape it must be the same on every rank.

A script is the same on every rank, but an option computed from the rank is not: a rank
that asks for another strategy, or whose options are refused while the others go on into
the start-up's collectives, would leave them waiting for ever. One allgather before the
strategy's first collective makes every rank raise instead, naming the ranks and the options
(`agreed`, around DistributedOptimizer's checks; `agreement_comm` says where, if anywhere).

Options are compared as the strategy reads them: one left out equals its default passed,
specs equal their parsed form, Horovod's compressors equal ashl's, and an option the
strategy does not take (refused or dropped on each rank by itself) is not compared. Under
"bsp" Horovod's keywords are compared too (they decide when each rank posts its allreduces
and what they reduce); the other strategies refuse them on each rank or honour them rank by rank
(backward_passes_per_step, sparse_as_dense: as an uneven data share is). Options
that are each rank's own (``evaluate``, ``eval_every_s``, ``heterogeneity``,
``server_threads``, ``global_model_on``, the sampler) are not compared either.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys
from typing import Optional, Sequence

from ..compression import check_compression
from ..coordinator import DriftConfig
from ..planner import PlannerConfig
from ..stages import StageConfig
from ..outer_spec import parse_outer
from ..staleness import parse_staleness
from ..strategies import strategy_class
from ..strategies.runtime import is_mpi, world_comm
from .exit import end_failed_start, start_watchdog
from .horovod_keywords import groups_key, op_name

__all__ = ["RUN_WIDE", "run_options", "disagreement", "agree", "agreed", "agreement_comm"]

# the options of DistributedOptimizer (beyond strategy, staleness and compression) that
# every rank must share: each changes what the ranks exchange or when
RUN_WIDE = ("overlap", "fault_tolerant", "fault_timeout_s", "transport", "server_rank",
            "outer_optimizer", "local_steps", "profile_steps", "profile_within_epoch",
            "staleness_fn", "planner_config", "stage_config", "drift_config")
# hvd.DistributedOptimizer's keywords that strategy "bsp" hands to Horovod: a rank with its
# own has its allreduces matched with other steps of the others' (one rank's every step with
# another's every second, their epochs drifting apart) or reduced otherwise
HOROVOD_RUN_WIDE = ("backward_passes_per_step", "op", "gradient_predivide_factor", "groups",
                    "sparse_as_dense")
# each option as the strategy reads it, so that two spellings of one value agree
_PARSED = {"outer_optimizer": parse_outer, "staleness_fn": parse_staleness,
           "compression": lambda c: check_compression(c, "", ("none", "fp16", "topk")),
           "planner_config": lambda c: PlannerConfig() if c is None else c,
           "stage_config": lambda c: StageConfig() if c is None else c,
           "drift_config": lambda c: DriftConfig() if c is None else c,
           "op": op_name, "gradient_predivide_factor": float, "sparse_as_dense": bool}


def _taken(strategy: str) -> Optional[dict]:
    """The options the strategy takes, with its defaults (None for an unknown name: the
    ranks agree on the name first, then make_strategy names it)."""
    try:
        cls = strategy_class(strategy)
    except ValueError:
        return None
    taken: dict = {}
    for klass in cls.__mro__:       # a subclass may pass **kwargs on to its base's
        for key, p in inspect.signature(klass.__init__).parameters.items():
            if p.default is not inspect.Parameter.empty:
                taken.setdefault(key, p.default)
    if "overlap" in taken:
        taken["overlap"] = bool(getattr(cls, "overlaps_by_default", False))
    if "outer_optimizer" in taken:
        taken["outer_optimizer"] = getattr(cls, "default_outer", None)
    if strategy == "ashl":          # staleness_fn= is its damping, passed on as staleness=
        taken["staleness_fn"] = taken["staleness"]
    return taken


def _text(key: str, value) -> str:
    """A value as comparable text: its parsed form where it has one; a repr that holds an
    address (an object) as its type's name and attributes."""
    try:
        value = _PARSED[key](value) if key in _PARSED else value
    except Exception:               # refused on its rank: the refusal is what travels
        pass
    text = repr(value)
    if " at 0x" in text:
        text = f"{type(value).__qualname__}({getattr(value, '__dict__', {})!r})"
    return text


def run_options(strategy: str, staleness, compression, config: dict,
                horovod: Optional[dict] = None, optimizer=None) -> dict:
    """This rank's run-wide options, as comparable text; `horovod`: the Horovod keywords
    given (hvd.DistributedOptimizer's, by name), compared under "bsp" (tensor groups as
    their positions among `optimizer`'s parameters)."""
    taken = _taken(strategy)
    options = {"strategy": strategy, "compression": compression}
    if strategy in ("ashl", "ssp"):
        options["staleness"] = staleness        # the bound; the others have none
    for key in RUN_WIDE:
        if taken is not None and key not in taken:
            continue
        value = config.get(key)
        options[key] = (taken or {}).get(key) if value is None else value
    if not options.get("fault_tolerant"):
        options.pop("fault_timeout_s", None)   # read only by a fault-tolerant run
    if strategy == "bsp" and horovod is not None:
        given = dict(horovod, groups=groups_key(horovod.get("num_groups", 0),
                                                horovod.get("groups"), optimizer))
        options.update((key, given[key]) for key in HOROVOD_RUN_WIDE if key in given)
    return {k: _text(k, v) for k, v in options.items()}


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _differences(views: Sequence[dict]) -> list[str]:
    """Each option whose text differs between ranks, with the ranks of each value; another
    strategy alone (the other options' defaults differ with it)."""
    keys = list(dict.fromkeys(k for options in views for k in options))
    if len({options.get("strategy") for options in views if options}) > 1:
        keys = ["strategy"]
    differing = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for r, options in enumerate(views):
            if not options:
                continue            # its rank refused before its options could be read
            by_value.setdefault(options.get(key, "(not taken)"), []).append(r)
        if len(by_value) > 1:
            differing.append(f"{key} is " + ", ".join(f"{v} on {_ranks(rs)}"
                                                     for v, rs in by_value.items()))
    return differing


def disagreement(views: Sequence[tuple[Optional[str], dict]]) -> Optional[str]:
    """What every rank must be told, given each rank's (refusal or None, run_options), in
    rank order; None if the ranks agree and none refused."""
    refusals = [f"{_ranks([r])}: {error}" for r, (error, _) in enumerate(views) if error]
    differing = _differences([options for _, options in views]) if views else []
    parts = []
    if refusals:
        parts.append("DistributedOptimizer's options were refused on " + "; ".join(refusals))
    if differing:
        parts.append("DistributedOptimizer's options differ between the ranks: "
                     + "; ".join(differing)
                     + " (every rank must pass the same: they start one run together)")
    return ". ".join(parts) or None


def agree(comm, refusal: Optional[str], options: dict) -> None:
    """Collective: every rank learns whether any rank refused its options or they differ;
    the others raise a ValueError saying so, and a rank that refused its own raises its own
    error (the caller's)."""
    verdict = disagreement(comm.allgather((refusal, options)))
    if verdict is not None and refusal is None:
        raise ValueError(verdict)


# ----------------------------------------------------------- at DistributedOptimizer's start
@contextlib.contextmanager
def agreed(comm, strategy: str, staleness, compression, config: dict,
           horovod: Optional[dict] = None, optimizer=None):
    """Around DistributedOptimizer's checks of the options: every rank raises if one refused
    its own or if the ranks' run-wide options differ (on `comm`; None: no agreement), so
    that none goes on into a start-up collective the others never reach. A fault-tolerant
    run agrees under its start-up's watchdog (a rank lost before it would leave the others
    waiting), and its failed start is left for ``python -m ashl.run``."""
    failure = options = None
    if comm is not None:
        try:
            options = run_options(strategy, staleness, compression, config, horovod, optimizer)
        except Exception as exc:    # (options the checks below refuse, most likely)
            options, failure = {}, exc
    try:
        yield
    except Exception as exc:    # any error on one rank would leave the others waiting
        failure = exc
    if comm is not None:
        try:
            with _watched(config, comm):
                agree(comm, failure and f"{type(failure).__name__}: {failure}", options)
        except ValueError as exc:
            failure = exc
    if failure is not None:
        if config.get("fault_tolerant"):
            end_failed_start(failure, config.get("comm"), abort=False)
        raise failure


def agreement_comm(config: dict, on_every_rank: bool):
    """Where the ranks agree on their options: the run's MPI world of two ranks or more.
    None for a test's in-process world, a replacement joining a fault-tolerant run (alone in
    its launch), and a Horovod that spans only some of the ranks (a process set, or
    hvd.init(comm=) on a part of the world: only its ranks build the optimizer)."""
    if not on_every_rank or config.get("fault_tolerant") and _joining():
        return None
    comm = config.get("comm")
    if comm is not None and not is_mpi(comm):
        return None
    comm = world_comm(comm)
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized() and hvd.size() != comm.Get_size():
        return None
    return comm if comm.Get_size() > 1 else None


def _joining() -> bool:
    from ..strategies.parameter_server import JOIN_ENV   # (it pulls in ZeroMQ: only here)
    return bool(os.environ.get(JOIN_ENV))


@contextlib.contextmanager
def _watched(config: dict, comm):
    """A fault-tolerant run's collective at start, under the start-up's watchdog."""
    if not config.get("fault_tolerant"):
        yield
        return
    from ..strategies.parameter_server import STARTUP_TIMEOUT_S
    timeout_s = config.get("startup_timeout_s") or STARTUP_TIMEOUT_S
    watchdog = start_watchdog(comm.Get_rank(), comm.Get_size(), timeout_s)
    try:
        yield
    finally:
        watchdog.cancel()
