"""Training strategies behind one optimizer wrapper (``strategy=`` of DistributedOptimizer).

ASHL: "ashl" (parameter server) and "ashl-sync" (allreduce). Baselines: "bsp" (Horovod's
DistributedOptimizer), "localsgd" (model averaging every H steps), "ssp" and "asp" (one step
per commit through the parameter server, bounded / no staleness), "adsp" (time-based
commits, online commit-rate search). The 2024 rivals: "diloco" (localsgd with an outer
Nesterov step) and "async-localsgd" (per-rank H from speed, asynchronous commits, Delayed
Nesterov on the server). Every strategy but bsp takes ``outer_optimizer=`` (outer.py).

Where things live: base.py (the control plane every strategy shares), control.py (the
synchronous strategies' allreduced control numbers and decisions), parameter_server.py (the
commit and the reply of ashl, ssp, asp, adsp), averaging.py (the allreduce round of
ashl-sync and localsgd), and one small module per strategy for what makes it different.
"""
from __future__ import annotations

import importlib

# name -> (module, class)
_REGISTRY = {
    "ashl": (".ashl", "AshlStrategy"),
    "ashl-sync": (".ashl_sync", "AshlSyncStrategy"),
    "bsp": (".bsp", "BspStrategy"),
    "localsgd": (".localsgd", "LocalSgdStrategy"),
    "ssp": (".ps_baselines", "SspStrategy"),
    "asp": (".ps_baselines", "AspStrategy"),
    "adsp": (".adsp", "AdspStrategy"),
    "diloco": (".diloco", "DilocoStrategy"),
    "async-localsgd": (".async_localsgd", "AsyncLocalSgdStrategy"),
}
STRATEGIES = tuple(_REGISTRY)
BASELINES = ("bsp", "localsgd", "ssp", "asp", "adsp", "diloco", "async-localsgd")
# fault_tolerant=True: the asynchronous strategies, which need no round of every rank; the
# synchronous ones (bsp, ashl-sync, localsgd, diloco) are fail-stop.
FAULT_TOLERANT = ("ashl", "ssp", "asp", "adsp", "async-localsgd")
# overlap=True: the parameter-server strategies, whose commits travel while a rank steps on
OVERLAPPING = FAULT_TOLERANT
# Those with save_checkpoint / load_checkpoint (bsp and ashl-sync keep base.Strategy's, which
# raise): named here so a command line can refuse the others before torch or MPI start.
CHECKPOINTING = tuple(s for s in STRATEGIES if s not in ("bsp", "ashl-sync"))


def strategy_class(name: str):
    """The class of strategy `name` (imported on first use: each pulls in MPI or Horovod)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module, __name__), cls)


def make_strategy(name: str, model, params, **kwargs):
    return strategy_class(name)(model, params, **kwargs)
