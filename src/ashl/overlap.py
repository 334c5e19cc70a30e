"""Overlapped commits: a rank keeps taking local steps while its commit is in flight.

At most one commit is in flight per rank. When its reply (the global model W) arrives, the
rank continues from W plus its own progress since the send, and W becomes its anchor:

    w <- W + (w - w_sent)        anchor <- W

so the progress made while the commit travelled is part of the next delta (w - anchor):
every local step reaches the server exactly once, none is lost or counted twice. Without
overlap w == w_sent when the reply arrives, and the rule is the usual w <- W.

The two halves are separate so that the server rank can evaluate W itself in between
(``take_progress``, then the reply's model is loaded, then ``add_progress``). Pure tensor
arithmetic: no I/O.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import kernels

__all__ = ["take_progress", "add_progress", "rebase"]


def take_progress(params: Sequence[torch.Tensor], sent: Sequence[torch.Tensor]) -> None:
    """sent[i] <- params[i] - sent[i]: the copy taken at the send becomes the progress since."""
    with torch.no_grad():   # one multi-tensor op per half, not one per parameter
        flat = kernels.flat_forms(params, sent)
        torch._foreach_sub_(list(flat[1]), list(flat[0]))
        torch._foreach_neg_(list(flat[1]))


def add_progress(params: Sequence[torch.Tensor], progress: Sequence[torch.Tensor]) -> None:
    """params[i] += progress[i] (params hold W, just loaded from the reply)."""
    with torch.no_grad():
        flat = kernels.flat_forms(params, progress)
        torch._foreach_add_(list(flat[0]), list(flat[1]))


def rebase(params: Sequence[torch.Tensor], anchors: Sequence[torch.Tensor],
           sent: Sequence[torch.Tensor], model: torch.Tensor) -> None:
    """The whole update: w <- W + (w - w_sent), anchor <- W, with W the flat fp32 `model`;
    `sent` (w_sent) is left holding the progress."""
    take_progress(params, sent)
    kernels.unpack_assign(params, anchors, model)
    add_progress(params, sent)
