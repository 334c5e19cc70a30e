"""Every rank starts one run: the options that shape it must be the same on every rank.

A script is the same on every rank, but an option computed from the rank is not: a rank
that asks for another strategy, or whose options are refused while the others go on into
the start-up's collectives, would leave them waiting for ever. One allgather before the
strategy's first collective makes every rank raise the same error instead, naming the
ranks and the options.

Options that are each rank's own (``evaluate``, ``eval_every_s``, ``heterogeneity``,
``server_threads``, ``global_model_on``, the sampler) are not compared.
"""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

from ..strategies import strategy_class

__all__ = ["RUN_WIDE", "run_options", "disagreement", "agree"]

# the options of DistributedOptimizer (beyond strategy, staleness and compression) that
# every rank must share: each changes what the ranks exchange or when
RUN_WIDE = ("overlap", "fault_tolerant", "fault_timeout_s", "transport", "server_rank",
            "outer_optimizer", "local_steps", "profile_steps", "profile_within_epoch",
            "staleness_fn", "planner_config", "stage_config", "drift_config")


def _canonical(value) -> str:
    """A value's repr, or its type's name where the repr holds an address (an object)."""
    text = repr(value)
    if " at 0x" in text:
        return f"{type(value).__module__}.{type(value).__qualname__}"
    return text


def _defaults(strategy: str) -> dict:
    """The strategy's own defaults, so that an option left out equals it passed as default."""
    try:
        cls = strategy_class(strategy)
    except ValueError:
        return {}       # an unknown name: make_strategy names it (the ranks agree on it first)
    defaults: dict = {}
    for klass in cls.__mro__:       # a subclass may pass **kwargs on to its base's
        for key, p in inspect.signature(klass.__init__).parameters.items():
            if p.default is not inspect.Parameter.empty:
                defaults.setdefault(key, p.default)
    if defaults.get("overlap") is None:
        defaults["overlap"] = bool(getattr(cls, "overlaps_by_default", False))
    return defaults


def run_options(strategy: str, staleness, compression, config: dict) -> dict:
    """This rank's run-wide options, as comparable text."""
    defaults = _defaults(strategy)
    options = {"strategy": strategy, "staleness": staleness, "compression": compression}
    for key in RUN_WIDE:
        value = config.get(key)
        options[key] = defaults.get(key) if value is None else value
    return {k: _canonical(v) for k, v in options.items()}


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def disagreement(views: Sequence[tuple[Optional[str], dict]]) -> Optional[str]:
    """What every rank must be told, given each rank's (refusal or None, run_options), in
    rank order; None if the ranks agree and none refused."""
    refusals = [f"{_ranks([r])}: {error}" for r, (error, _) in enumerate(views) if error]
    differing = []
    for key in views[0][1] if views else ():
        by_value: dict[str, list[int]] = {}
        for r, (_, options) in enumerate(views):
            by_value.setdefault(options.get(key, "(missing)"), []).append(r)
        if len(by_value) > 1:
            differing.append(f"{key} is " + ", ".join(f"{v} on {_ranks(rs)}"
                                                     for v, rs in by_value.items()))
    if differing and differing[0].startswith("strategy "):
        differing = differing[:1]   # the other options' defaults differ with it
    if not refusals and not differing:
        return None
    parts = []
    if refusals:
        parts.append("DistributedOptimizer's options were refused on "
                     + "; ".join(refusals))
    if differing:
        parts.append("DistributedOptimizer's options differ between the ranks: "
                     + "; ".join(differing)
                     + " (every rank must pass the same: they start one run together)")
    return ". ".join(parts)


def agree(comm, refusal: Optional[str], options: dict) -> None:
    """Collective: every rank raises the same ValueError if any rank refused its options or
    they differ; a rank that refused its own raises its own error (the caller's)."""
    verdict = disagreement(comm.allgather((refusal, options)))
    if verdict is not None and refusal is None:
        raise ValueError(verdict)
