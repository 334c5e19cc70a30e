"""Training strategies behind one optimizer wrapper (``strategy=`` of DistributedOptimizer).

ASHL: "ashl" (parameter server) and "ashl-sync" (allreduce). Baselines: "bsp" (Horovod's
DistributedOptimizer), "localsgd" (model averaging every H steps), "ssp" and "asp" (one step
per commit through the parameter server, bounded / no staleness), "adsp" (time-based
commits, online commit-rate search).
"""
from __future__ import annotations

STRATEGIES = ("ashl", "ashl-sync", "bsp", "localsgd", "ssp", "asp", "adsp")
BASELINES = ("bsp", "localsgd", "ssp", "asp", "adsp")


def make_strategy(name: str, model, params, **kwargs):
    if name == "ashl":
        from .ashl import AshlStrategy
        return AshlStrategy(model, params, **kwargs)
    if name == "ashl-sync":
        from .ashl_sync import AshlSyncStrategy
        return AshlSyncStrategy(model, params, **kwargs)
    if name == "bsp":
        from .bsp import BspStrategy
        return BspStrategy(model, params, **kwargs)
    if name == "localsgd":
        from .localsgd import LocalSgdStrategy
        return LocalSgdStrategy(model, params, **kwargs)
    if name == "ssp":
        from .ps_baselines import SspStrategy
        return SspStrategy(model, params, **kwargs)
    if name == "asp":
        from .ps_baselines import AspStrategy
        return AspStrategy(model, params, **kwargs)
    if name == "adsp":
        from .adsp import AdspStrategy
        return AdspStrategy(model, params, **kwargs)
    raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
