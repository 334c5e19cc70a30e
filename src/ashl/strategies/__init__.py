"""Training strategies behind one optimizer wrapper (``strategy=`` of DistributedOptimizer)."""
from __future__ import annotations

STRATEGIES = ("ashl", "ashl-sync")


def make_strategy(name: str, model, params, **kwargs):
    if name == "ashl":
        from .ashl import AshlStrategy
        return AshlStrategy(model, params, **kwargs)
    if name == "ashl-sync":
        from .ashl_sync import AshlSyncStrategy
        return AshlSyncStrategy(model, params, **kwargs)
    raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
