"""``ashl.torch.DistributedOptimizer``: wraps a torch optimizer the way
``horovod.torch.DistributedOptimizer`` does; the result is still an instance of the user's
optimizer class (its param_groups and state are the same objects, so LR schedulers and
``state_dict`` keep working). ``step(loss=...)`` takes a local step and lets the strategy
decide when to communicate.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from collections import Counter
from typing import Optional

import torch

from ..strategies import FAULT_TOLERANT, OVERLAPPING, PARAMETER_SERVER, make_strategy
from ..strategies.join import wrap_scripts_join
from ..strategies.model_state import store_flat
from .agreement import agreed, agreement_comm
from .exit import end_failed_start, leave_at_exit
from .horovod_keywords import HorovodKeywords, on_every_rank

log = logging.getLogger("ashl")

# Where Horovod's DistributedOptimizer lives (horovod.torch.functions compares with it).
_HOROVOD_OPTIMIZER_MODULE = "horovod.torch.optimizer"


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class."""

    def step(self, closure=None, loss=None):
        if self._ashl.finished:
            return self._after_the_end()
        if self._ashl_scaler_skipped():
            return self._ashl_step(closure)   # the optimizer skips its own update
        self._ashl.before_step()
        result = self._ashl_step(closure)
        if loss is None and closure is not None:
            loss = result
        self._ashl.after_step(loss)
        return result

    def _after_the_end(self):
        """The run has ended (a target or a budget) while the loop goes on: the model stays
        the final global model, so a step does nothing (said once)."""
        if not getattr(self, "_ashl_warned", False):
            self._ashl_warned = True
            log.warning("rank %d: the run has ended (%s); step() does nothing from now on "
                        "(end the loop on opt.finished)", self._ashl.rank, self._ashl.stop_reason)
        if getattr(self, "_ashl_horovod", False):   # strategy "bsp": complete Horovod's allreduces
            self.synchronize()
        return None

    def _ashl_scaler_skipped(self) -> bool:
        return False

    def _ashl_step(self, closure=None):
        """The local update: the user's optimizer's step (strategy "bsp": Horovod's, which
        synchronizes the allreduced gradients first)."""
        return super(self.__class__, self).step(closure)

    @property
    def finished(self) -> bool:
        """True once the run is over for this rank (target, budget or stop). A run without
        a target or budget ends only when the loop ends, so a loop on it would never end:
        reading it then is an error."""
        s = self._ashl
        if (not s.finished and not s.stage_config.can_stop(s.evaluates)
                and not getattr(self, "_ashl_closed", False)):
            raise ValueError("opt.finished: this run has no target and no budget, so it ends only "
                             "when the training loop ends; loop over epochs, or give "
                             "stage_config=StageConfig(max_seconds=..., max_commits=... or "
                             "target_accuracy=... with evaluate=...)")
        return s.finished

    @property
    def plan(self):
        return self._ashl.plan

    @property
    def stage(self) -> str:
        return self._ashl.stage_label

    @property
    def strategy(self):
        return self._ashl

    def counters(self) -> dict:
        return self._ashl.counters()

    def set_epoch(self, epoch: int) -> None:
        """Tell ashl the epoch (as for a sampler); reported with commits."""
        self._ashl.set_epoch(epoch)

    def save_checkpoint(self, path: str) -> None:
        """Write the run to ``path`` (server rank; rank 0 for the synchronous strategies) and
        this rank's state to ``path.rank<r>``, atomically. Not collective. A parameter-server
        strategy's ranks may call it wherever suits each; localsgd, diloco and ashl-sync must
        call it on every rank at the same point of the loop (after an epoch), so that every
        rank's part is of the same round."""
        self._ashl.save_checkpoint(path, self)

    def load_checkpoint(self, path: str) -> dict:
        """Before the first step, on every rank: continue the run saved at ``path``
        (global model, plan, stage, counters, this rank's optimizer state). Returns where
        this rank was in its data, ``{"epoch": e, "steps_in_epoch": n}``: a loop that
        continues epoch e past its first n batches picks up where the save left off."""
        self._ashl.load_checkpoint(path, self)
        return dict(self._ashl.resumed_at)

    def finish(self) -> None:
        """Collective, once per rank at the end: leave the run and end with the final global
        model on every rank."""
        if not getattr(self, "_ashl_closed", False):
            self._ashl_closed = True
            self._ashl.finish()


class _DeltaOptimizer(torch.optim.Optimizer):
    """The strategies that merge model deltas: a step is local (its gradients are this
    rank's own), so Horovod's synchronize() has nothing to wait for. Kept so that Horovod's
    clip and GradScaler recipe (synchronize(), unscale or clip, then step() within
    skip_synchronize()) runs unchanged."""

    def synchronize(self) -> None:
        """Nothing to wait for: the gradients are this rank's own."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        yield

    def _ashl_scaler_skipped(self) -> bool:
        """GradScaler found an inf or NaN and set ``found_inf`` around a fused optimizer's
        step(), which then skips its update itself: not a local step, as with any other
        optimizer, whose step() GradScaler does not call at all."""
        found_inf = getattr(self, "found_inf", None)
        return isinstance(found_inf, torch.Tensor) and bool(found_inf.item())


class _StagedBspOptimizer(torch.optim.Optimizer):
    """Strategy "bsp" where Horovod cannot take the gradients (bsp.py): ashl averages them
    at step(), with Horovod's synchronize() and skip_synchronize() for the scripts that
    unscale or clip between the two (GradScaler)."""

    def synchronize(self) -> None:
        """Average the gradients now; the next step() does not average them again."""
        self._ashl.average_gradients()
        self._ashl_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() within it does not average: synchronize() was called already."""
        self._ashl_skip = True
        try:
            yield
        finally:
            self._ashl_skip = False

    def _ashl_step(self, closure=None):
        if not (getattr(self, "_ashl_synchronized", False) or getattr(self, "_ashl_skip", False)):
            self._ashl.average_gradients()
        self._ashl_synchronized = False
        return super(self.__class__, self).step(closure)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=None, backward_passes_per_step: int = 1, op=None,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, sparse_as_dense: bool = False, process_set=None, *,
                         model: Optional[torch.nn.Module] = None, sampler=None,
                         strategy: str = "ashl", staleness: int = 3,
                         flat_storage: Optional[bool] = None, **config):
    """Wrap ``optimizer`` for heterogeneity-aware training, as ``hvd.DistributedOptimizer``.

    Horovod's arguments come first, in Horovod's order, and mean what they mean there where a
    strategy that merges model deltas can honour them (``horovod_keywords.py`` says which;
    the others raise a ValueError naming them). Strategy "bsp" hands them to Horovod.

    compression: force a compressor for every commit: ``Compression.none``, ``.fp16`` or
        ``.topk(ratio)`` (Horovod's ``hvd.Compression.fp16`` is taken as ashl's; its default
        ``hvd.Compression.none``, which its examples pass, as no choice). Default:
        the plan's (dense in AHL, top-k at each rank's planned ratio in SHL). The
        parameter-server strategies take all three; "bsp" none and fp16 (Horovod's, on the
        gradients); "ashl-sync" and "localsgd" only none. Others raise a ValueError.
    model: the module whose parameters and floating-point buffers (BatchNorm statistics)
        travel; without it, named_parameters, else the optimizer's parameters.
    sampler: a HeterogeneousSampler; it receives the plan's data shares.
    strategy: "ashl" (parameter server, AHL then SHL) or "ashl-sync" (the same per-rank
        local steps, each round ending in one hvd.allreduce_), or a baseline: "bsp"
        (Horovod's own DistributedOptimizer underneath), "localsgd", "ssp", "asp", "adsp",
        "diloco", "async-localsgd" (see ashl.strategies).
    staleness: SHL's bound s (a rank at most s commits ahead of the slowest); strategy
        "ssp": its bound.
    flat_storage: store the parameters and floating-point buffers that travel in one
        contiguous buffer, each a view of it (when they share a dtype and a device and no
        two share memory), so a commit's kernels run once on that buffer, not once per
        tensor. The tensors stay the model's own objects with their values; whatever was
        derived from their storage before (a ``.data``, a view, a state_dict's tensors)
        stops seeing the model. Default (None): on for a CPU model, off for a GPU model
        (the CUDA kernels take many tensors in one launch, and views packed back to back
        lose the alignment torch's vectorised kernels want) and for "bsp" (its parameters
        never pass through the kernels).
    config: strategy options (outer_optimizer: "none", "nesterov(lr, momentum)" or
        "delayed-nesterov(lr, momentum, n)", applied to the merged deltas (ashl.outer);
        local_steps for localsgd, diloco and async-localsgd; profile_steps, staleness_fn,
        server_rank, planner_config, stage_config, drift_config, evaluate, eval_every_s,
        heterogeneity; fault_tolerant=True and fault_timeout_s for the asynchronous strategies:
        a worker that dies or falls silent is dropped and the others go on, docs/LAUNCHING.md;
        transport="zmq" (default) or "mpi" for the parameter-server strategies: how commits
        travel, docs/LAUNCHING.md; global_model_on="host" (default) or "device" for them:
        where the server rank keeps the global model (on a GPU: its model's device, each
        commit copied there, the CUDA kernels merging), docs/DESIGN.md "Models on GPUs";
        server_threads for them: the CPU kernel threads of the server's merges (default:
        OpenMP's, OMP_NUM_THREADS or every core; 1 keeps them off a CPU rank's training
        cores without narrowing torch's threads);
        overlap for the parameter-server strategies: a rank keeps taking local steps
        while its commit is in flight, docs/DESIGN.md "Overlapped commits" (default: on for
        ashl, off for the others); profile_within_epoch for ashl and async-localsgd (default
        True): while the slowest rank profiles, the faster ones step on only to the end of
        their epoch, so that a script's collectives between epochs line up; False lets them
        step on across epochs, for a script that calls none there.

    ``finish()`` is optional: a rank leaves the run by itself when the interpreter exits
    (before MPI is finalised), and every rank ends with the final global model.
    """
    keywords = dict(backward_passes_per_step=backward_passes_per_step, op=op,
                    gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                    groups=groups, sparse_as_dense=sparse_as_dense, process_set=process_set)
    comm = agreement_comm(config, on_every_rank(process_set))
    with agreed(comm, strategy, staleness, compression, config, keywords, optimizer):
        _check_optimizer(optimizer)
        horovod = HorovodKeywords(**keywords)   # (refused here on one rank: every rank raises)
        if strategy != "bsp":
            horovod.check_for_deltas(strategy)
        if named_parameters is not None:
            named_parameters = _checked_named_parameters(optimizer, named_parameters)
        if model is not None:
            _check_model_holds(optimizer, model)
        params = _params(optimizer, model, named_parameters)
        options = _strategy_options(strategy, staleness, config)
    engine = _build_strategy(strategy, model, params, options, comm, sampler=sampler,
                             compression=compression, flat_storage=flat_storage)
    if strategy == "bsp" and not engine.staged_gradients:
        _check_horovod_allreduces(horovod)     # (alike on every rank: raised on each)
        with _failure_ends_the_job(options, comm):     # (Horovod's own checks, on one rank)
            wrapped = _wrap_horovod(optimizer, model, named_parameters,
                                    dict(horovod.for_horovod(),
                                         compression=engine.horovod_compression))
    else:
        if strategy == "bsp":   # a CUDA model, a Horovod without GPU operations (bsp.py)
            horovod.check_for_staged_gradients()
        wrapped = _rewrap(optimizer, _StagedBspOptimizer if strategy == "bsp"
                          else _DeltaOptimizer)
    wrapped._ashl = engine
    engine.optimizer = wrapped
    engine.backward_passes_per_step = backward_passes_per_step
    engine.sparse_as_dense = sparse_as_dense
    _wrap_the_scripts_join()
    leave_at_exit(wrapped)
    return wrapped


def _check_optimizer(optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if type(optimizer).__module__ == _HOROVOD_OPTIMIZER_MODULE:
        raise ValueError("optimizer is a distributed optimizer already (hvd.DistributedOptimizer "
                         "or ashl.torch.DistributedOptimizer): pass the torch optimizer itself; "
                         "ashl's replaces Horovod's, it does not wrap it")


def _build_strategy(strategy: str, model, params, options: dict, comm, *, sampler,
                    compression, flat_storage):
    """The strategy engine."""
    with _failure_ends_the_job(options, comm):
        _store_flat(model, params, strategy, flat_storage)
        return make_strategy(strategy, model, params, sampler=sampler,
                             compression=compression, **options)


@contextlib.contextmanager
def _failure_ends_the_job(options: dict, comm):
    """A start that fails on a rank after the ranks agreed (a rank's own option refused, a
    port taken, memory, Horovod's own checks) ends the job, where the others would wait for
    it in the start-up's collectives; in a test's in-process world, or alone, it raises."""
    try:
        yield
    except Exception as exc:
        if options.get("fault_tolerant"):
            end_failed_start(exc, options.get("comm"))
        elif comm is not None:
            end_failed_start(exc, comm, fault_tolerant=False)
        raise


def _rewrap(optimizer: torch.optim.Optimizer, mixin: type) -> torch.optim.Optimizer:
    """The optimizer as an instance of a subclass of its own class with `mixin`'s methods,
    sharing its param_groups and state objects, as Horovod's wrapper does."""
    body = dict(_DistributedOptimizer.__dict__)
    body.update((k, v) for k, v in mixin.__dict__.items()
                if k not in ("__dict__", "__weakref__", "__module__", "__doc__"))
    # hvd.broadcast_optimizer_state makes an empty state with one step() on zero
    # gradients, the wrapped optimizer's own unless the class's module is Horovod's
    # (a strategy's step would start the run, or wait in a collective the root skips).
    body["__module__"] = _HOROVOD_OPTIMIZER_MODULE
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), body)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)   # the same param_groups and state objects
    # An LR scheduler built before wrapping left the old object's step() in its
    # __dict__ (bound to it): it would bypass ashl's. Its lr changes still reach the
    # shared param_groups, as with Horovod's wrapper.
    wrapped.__dict__.pop("step", None)
    return wrapped


def _wrap_the_scripts_join() -> None:
    """The script's hvd.join() must be told apart from finish()'s (strategies/join.py);
    before hvd.init() too (a parameter-server strategy does not need Horovod at the start)."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None:
        wrap_scripts_join(hvd)


def _store_flat(model, params, strategy: str, flat_storage: Optional[bool]) -> None:
    """flat_storage=: the model stored flat (model_state.store_flat) where asked or, by
    default, where it pays; a refusal asked for explicitly is logged as a warning."""
    if flat_storage is not None and not isinstance(flat_storage, bool):
        raise ValueError(f"flat_storage must be True, False or None, got {flat_storage!r}")
    asked = flat_storage is True
    if flat_storage is None:
        flat_storage = strategy != "bsp" and params[0].device.type == "cpu"
    if flat_storage:
        why = store_flat(model, params)
        if why is not None and why != "stored flat already":
            log.log(logging.WARNING if asked else logging.INFO,
                    "flat_storage: the model is not stored flat (%s): its kernels run "
                    "tensor by tensor", why)


def _optimizer_params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _checked_named_parameters(optimizer, named_parameters) -> list:
    """Horovod's three checks: (name, parameter) pairs, unique names, every parameter of the
    optimizer named (one left out would never travel, and the ranks' copies drift apart)."""
    named = list(named_parameters)
    if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], torch.Tensor)
               for p in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually produced by model.named_parameters()")
    duplicates = sorted(str(n) for n, k in Counter(name for name, _ in named).items() if k > 1)
    if duplicates:
        raise ValueError("parameter names in named_parameters must be unique; found "
                         f"duplicates: {', '.join(duplicates)}")
    given = {id(p) for _, p in named}
    unnamed = [i for i, p in enumerate(_optimizer_params(optimizer)) if id(p) not in given]
    if unnamed:
        raise ValueError(f"named_parameters was given, but {len(unnamed)} of the optimizer's "
                         f"parameters are not in it (positions {unnamed[:10]} in its "
                         "param_groups): they would never be synchronised")
    return named


def _check_model_holds(optimizer, model) -> None:
    """model= says what travels: an optimizer parameter outside it (a learnable loss weight,
    another module's) would train apart on every rank."""
    held = {id(p) for p in model.parameters()}
    outside = [i for i, p in enumerate(_optimizer_params(optimizer)) if id(p) not in held]
    if outside:
        raise ValueError(f"{len(outside)} of the optimizer's parameters (positions "
                         f"{outside[:10]} in its param_groups) are not parameters of model=: "
                         "they would never be synchronised; make them part of the model")


def _params(optimizer, model, named_parameters) -> list:
    if model is not None:
        params = [p for p in model.parameters()]
    elif named_parameters is not None:
        params = [p for _, p in named_parameters]
    else:
        params = _optimizer_params(optimizer)
    if not params:
        raise ValueError("no parameters to train")
    return params


def _strategy_options(strategy: str, staleness, config: dict) -> dict:
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness must be an integer >= 0, got {staleness!r}")
    kwargs = dict(config)
    # An option's "off" passes for a strategy without it (a CLI passes --no-overlap as is).
    for key, applies in (("overlap", strategy in OVERLAPPING),
                         ("fault_tolerant", strategy in FAULT_TOLERANT),
                         ("outer_optimizer", strategy != "bsp")):
        if not applies and key in kwargs and kwargs[key] in (None, False):
            del kwargs[key]
    if kwargs.get("fault_tolerant") and strategy not in FAULT_TOLERANT:
        raise ValueError(f"fault_tolerant=True: strategy {strategy!r} is synchronous and "
                         "fail-stop (every round needs every rank); a run that survives a lost "
                         f"worker uses {', '.join(FAULT_TOLERANT)}")
    if "transport" in kwargs and strategy not in PARAMETER_SERVER:
        raise ValueError(f"transport={kwargs['transport']!r}: strategy {strategy!r} has no "
                         "parameter server (its rounds are Horovod allreduces); transport= is "
                         f"for {', '.join(PARAMETER_SERVER)}")
    if "global_model_on" in kwargs and strategy not in PARAMETER_SERVER:
        raise ValueError(f"global_model_on={kwargs['global_model_on']!r}: strategy {strategy!r} "
                         "has no parameter server (its rounds are Horovod allreduces); "
                         f"global_model_on= is for {', '.join(PARAMETER_SERVER)}")
    if "server_threads" in kwargs and strategy not in PARAMETER_SERVER:
        raise ValueError(f"server_threads={kwargs['server_threads']!r}: strategy {strategy!r} "
                         "has no parameter server (its rounds are Horovod allreduces); "
                         f"server_threads= is for {', '.join(PARAMETER_SERVER)}")
    if kwargs.get("overlap") and strategy not in OVERLAPPING:
        raise ValueError(f"overlap=True: strategy {strategy!r} exchanges in collectives, with no "
                         "commit in flight to overlap; the parameter-server strategies "
                         f"({', '.join(OVERLAPPING)}) overlap their commits")
    if strategy == "bsp" and kwargs.get("outer_optimizer") is not None:
        raise ValueError("outer_optimizer: strategy 'bsp' averages gradients every step "
                         "(Horovod's DistributedOptimizer); an outer optimizer needs a strategy "
                         "that merges model deltas (ashl, ashl-sync, diloco, async-localsgd, ...)")
    if "profile_within_epoch" in kwargs and strategy not in ("ashl", "async-localsgd"):
        raise ValueError(f"profile_within_epoch applies to the strategies whose faster ranks "
                         f"step on while the slowest profiles (ashl, async-localsgd), not "
                         f"{strategy!r}")
    if "staleness_fn" in kwargs:
        if strategy != "ashl":
            raise ValueError(f"staleness_fn applies to strategy='ashl', not {strategy!r}")
        kwargs["staleness"] = kwargs.pop("staleness_fn")
    if strategy in ("ashl", "ssp"):
        kwargs["bound"] = staleness
    return kwargs


def _check_horovod_allreduces(horovod: HorovodKeywords) -> None:
    """Strategy "bsp" wraps Horovod's allreduce optimizer; with op=Adasum on more than one
    rank Horovod builds its Adasum optimizer instead (horovod/torch/optimizer.py, 0.28),
    which has no synchronize() for step() to report through."""
    import horovod.torch as hvd
    if horovod.op == hvd.Adasum and hvd.size() > 1:
        raise RuntimeError("strategy 'bsp' needs Horovod's allreduce optimizer (op=Average or "
                           "Sum, not Adasum)")


def _wrap_horovod(optimizer: torch.optim.Optimizer, model, named_parameters, horovod: dict):
    """Strategy "bsp": ``hvd.DistributedOptimizer(optimizer, named_parameters=...)`` itself
    (gradient allreduce hooks, synchronize() in step()), with ashl's methods added so step()
    still reports to the strategy.

    Horovod builds its result as ``type(name, (user class,), dict(horovod's methods))`` and
    its methods call ``super(self.__class__, self)``, so that class cannot be subclassed
    again. Instead its instance (whose backward hooks are bound to it) gets a class of the
    same shape: the user's class as the base, Horovod's methods, then ashl's, with
    ``_ashl_step`` = Horovod's step. The result is an instance of the user's optimizer class
    whose methods (synchronize, step, zero_grad, load_state_dict...) are Horovod's own
    functions. Like Horovod's, it is a new optimizer over the same param_groups (optimizer
    state starts empty: wrap before loading any state)."""
    import horovod.torch as hvd
    from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer

    if named_parameters is None and model is not None:
        named_parameters = list(model.named_parameters())
    inner = hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters, **horovod)
    body = {k: v for k, v in type(inner).__dict__.items() if k not in ("__dict__", "__weakref__")}
    body.update((k, v) for k, v in _DistributedOptimizer.__dict__.items()
                if k not in ("__dict__", "__weakref__", "__module__", "__doc__"))
    body["_ashl_step"] = _HorovodOptimizer.step
    body["_ashl_horovod"] = True
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), body)
    inner.__class__ = cls
    return inner
