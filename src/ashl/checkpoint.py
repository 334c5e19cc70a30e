"""Checkpoints of an ashl run, written atomically.

``save(path, ...)`` writes to ``path.tmp<pid>``, flushes and fsyncs it, then renames it over
``path``: a process killed mid-write leaves the previous checkpoint loadable. In an
asynchronous run the ranks are never at the same point, so a checkpoint is not collective:
the server rank writes the run file (global model, plan, stage, counters) and every rank its
own optimizer state to ``<path>.rank<r>``.
"""
from __future__ import annotations

import os
from typing import Any

import torch

FORMAT = 1


def rank_path(path: str, rank: int) -> str:
    return f"{path}.rank{rank}"


def atomic_save(obj: Any, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def check_run(run: dict, path: str, strategy: str, size: int, numel: int) -> None:
    """A run file must come from a job like this one: the same rank count, model size and
    strategy (every rank checks, before any starts, so a mismatch stops them all alike)."""
    if run.get("size") != size:
        raise ValueError(f"checkpoint {path} is of a {run.get('size')}-rank run; "
                         f"this job has {size} ranks")
    if run.get("numel") != numel:
        raise ValueError(f"checkpoint {path} holds a model of {run.get('numel')} elements; "
                         f"this model has {numel}")
    if run.get("strategy", strategy) != strategy:
        raise ValueError(f"checkpoint {path} is of strategy {run.get('strategy')!r}; this run "
                         f"is {strategy!r}")


def save_rank(path: str, rank: int, optimizer, counters: dict, epoch: int, **extra) -> None:
    """This rank's own part: its optimizer state, counters and epoch (``path.rank<r>``)."""
    atomic_save({"format": FORMAT, "rank": rank, "optimizer": optimizer.state_dict(),
                 "counters": counters, "epoch": epoch, **extra}, rank_path(path, rank))


def load(path: str) -> dict:
    """A checkpoint written by `atomic_save`, checked for the fields ashl needs."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear error
        raise ValueError(f"checkpoint {path} is not readable: {exc}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path} is not an ashl checkpoint (format {FORMAT})")
    return obj
