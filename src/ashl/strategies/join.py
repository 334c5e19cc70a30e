"""Meeting in Horovod's join at the end of a run, told apart from a script's own joins.

Every strategy's ``finish()`` meets the other ranks in ``hvd.join()`` before its last
collectives: a rank that left its loop early waits there while Horovod completes the others'
allreduces with zeros in its place (Horovod's recipe for uneven data). But ``hvd.join()``
returns once every rank has joined, whichever join each called: if the others call
``hvd.join()`` in their own script (the same recipe, after each epoch's loop), the early
rank's join returns too, and it goes on to the run's last collectives while the others go on
with their script; both wait for ever.

So every join on a rank that runs ashl is followed by one allreduce that counts the ranks
that called it from ``finish()``: the script's ``hvd.join`` is wrapped (``wrap_scripts_join``,
when the first optimizer is built, on every rank alike, before or after ``hvd.init()``),
and ``finish()`` joins again until every rank is finishing. Every rank leaves a join at the
same moment, so every rank takes part in the count that follows it.
"""
from __future__ import annotations

import functools
import sys

import torch

__all__ = ["wrap_scripts_join", "join_until_every_rank_finishes", "horovod_join",
           "join_the_scripts_horovod"]

_COUNT_NAME = "ashl.join.finishing"
_JOIN = "_ashl_uncounted_join"      # on the wrapper: the join it wraps


def wrap_scripts_join(hvd) -> None:
    """Make ``hvd.join`` (the module's, which a script calls) count the finishing ranks after
    it returns, as finish()'s joins do. Idempotent. (A reference the script took before,
    ``from horovod.torch import join``, is not wrapped: its joins are not counted.)"""
    if getattr(hvd.join, _JOIN, None) is not None:
        return
    joined = hvd.join

    @functools.wraps(joined)
    def join(device=-1):
        last = joined(device)
        _finishing_ranks(hvd, finishing=False)
        return last

    setattr(join, _JOIN, joined)
    hvd.join = join


def join_until_every_rank_finishes(hvd, device: int = -1) -> None:
    """``hvd.join()`` until every rank has joined from finish(), not from its script."""
    joined = getattr(hvd.join, _JOIN, None) or hvd.join
    while True:
        joined(device)
        if _finishing_ranks(hvd, finishing=True) == hvd.size():
            return


def _finishing_ranks(hvd, finishing: bool) -> int:
    count = torch.tensor([1.0 if finishing else 0.0], dtype=torch.float32, device="cpu")
    hvd.allreduce_(count, op=hvd.Sum, name=_COUNT_NAME)
    return round(float(count[0]))


def horovod_join(hvd, staging) -> None:
    """finish()'s join for a strategy whose rounds are Horovod allreduces: the zeros it adds
    to the others' rounds meanwhile are made where those rounds reduce (a tensor's CUDA
    device, unless they are staged through host memory)."""
    device = staging.device
    join_until_every_rank_finishes(
        hvd, device.index if device.type == "cuda" and not staging.staged else -1)


def join_the_scripts_horovod() -> None:
    """Where a script runs Horovod beside a strategy that does not use it (the parameter-server
    ones), every rank meets in ``hvd.join()`` before the run's last collectives. A rank that
    left its loop early then completes the others' allreduces of the script's own (an epoch's
    metrics) with zeros, as Horovod's recipe for uneven data does, instead of leaving them
    waiting for ever; with every rank on time it returns at once."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        join_until_every_rank_finishes(hvd)
