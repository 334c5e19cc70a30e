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
# Those that train through the parameter server (parameter_server.py), which take transport=.
PARAMETER_SERVER = ("ashl", "ssp", "asp", "adsp", "async-localsgd")
# fault_tolerant=True: the asynchronous strategies, which need no round of every rank; the
# synchronous ones (bsp, ashl-sync, localsgd, diloco) are fail-stop.
FAULT_TOLERANT = PARAMETER_SERVER
# How commits travel (ashl.transport): ZeroMQ (event-driven waits, the server rank's own
# commits in-process) or MPI point-to-point (sleep-polled; for fabrics where MPI is faster).
TRANSPORTS = ("zmq", "mpi")
DEFAULT_TRANSPORT = "zmq"
# overlap=True: the parameter-server strategies, whose commits travel while a rank steps on
OVERLAPPING = PARAMETER_SERVER
# Those with save_checkpoint / load_checkpoint (bsp keeps base.Strategy's, which raise):
# named here so a command line can refuse the others before torch or MPI start.
CHECKPOINTING = tuple(s for s in STRATEGIES if s != "bsp")


def transport_problem(transport, fault_tolerant: bool = False) -> "str | None":
    """Why `transport` cannot carry a run's commits (None if it can): an unknown name, or
    a fault-tolerant run over MPI (a lost rank is seen only through ZeroMQ's connections)."""
    if transport not in TRANSPORTS:
        return f"unknown transport {transport!r} (known: {', '.join(TRANSPORTS)})"
    if fault_tolerant and transport != "zmq":
        return (f"a fault-tolerant run needs transport 'zmq', not {transport!r} (a lost rank "
                "is seen through ZeroMQ's connections; over MPI it ends the whole job)")
    return None


def strategy_class(name: str):
    """The class of strategy `name` (imported on first use: each pulls in MPI or Horovod)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; expected one of {', '.join(STRATEGIES)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module, __name__), cls)


def make_strategy(name: str, model, params, **kwargs):
    return strategy_class(name)(model, params, **kwargs)
