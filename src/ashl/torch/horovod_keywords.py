"""The keywords of ``hvd.DistributedOptimizer`` (Horovod 0.28), as ashl reads them.

A converted Horovod script passes them unchanged. Strategy "bsp" hands them to Horovod as
they are. The other strategies send model deltas, not gradients, so each keyword is either
honoured where it has a meaning there or refused with a ValueError that names it and says why:

(``compression`` is the strategy's own argument: Horovod's none/fp16 become ashl's.)

    backward_passes_per_step    honoured: as in Horovod, one step() follows that many backward
                                passes; each step() is one local step (counted in counters())
    op                          Average (the merge is a weighted average); Sum, Adasum refused
    gradient_predivide_factor   1.0; another value is refused (there is no gradient sum to
                                split: the server merges fp32 deltas)
    num_groups, groups          0 / None; grouping is refused (a commit is always the whole
                                model in one fused buffer)
    sparse_as_dense             honoured: deltas are always dense
    process_set                 the global process set; any other is refused

Strategy "bsp" on a CUDA model under a Horovod without GPU operations averages the gradients
itself (strategies/bsp.py): op Average and the global process set only; the other keywords
keep their meaning (the average is the same, one allreduce per gradient dtype; a sparse
gradient is averaged dense, and given back sparse unless ``sparse_as_dense``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["HorovodKeywords", "op_name", "groups_key", "on_every_rank"]


def _horovod():
    try:
        import horovod.torch as hvd
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return hvd


def op_name(op) -> str:
    """Horovod's reduction by name (None: its default, Average)."""
    if op is None:
        return "Average"
    hvd = _horovod()
    if hvd is not None:
        for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
            if getattr(hvd, name, object()) == op:
                return name
    return repr(op)


@dataclass(frozen=True)
class HorovodKeywords:
    """hvd.DistributedOptimizer's keywords beyond the optimizer and named_parameters."""

    backward_passes_per_step: int = 1
    op: Any = None                      # None: Horovod's default, Average
    gradient_predivide_factor: float = 1.0
    num_groups: int = 0
    groups: Any = None
    sparse_as_dense: bool = False
    process_set: Any = None             # None: the global process set

    def __post_init__(self):
        b = self.backward_passes_per_step
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {b!r}")
        f = self.gradient_predivide_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
            raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {f!r}")

    def for_horovod(self) -> dict:
        """Strategy "bsp": Horovod's own keywords, untouched (defaults where not given)."""
        out = {"backward_passes_per_step": self.backward_passes_per_step,
               "gradient_predivide_factor": self.gradient_predivide_factor,
               "num_groups": self.num_groups, "groups": self.groups,
               "sparse_as_dense": self.sparse_as_dense}
        if self.op is not None:
            out["op"] = self.op
        if self.process_set is not None:
            out["process_set"] = self.process_set
        return out

    def check_for_deltas(self, strategy: str) -> None:
        """Strategies that merge model deltas: refuse what has no meaning there."""
        hvd = _horovod()
        if self.op is not None and (hvd is None or self.op != hvd.Average):
            raise ValueError(f"op={op_name(self.op)}: strategy {strategy!r} merges model deltas "
                             "as a weighted average (op=hvd.Average); use strategy='bsp' for "
                             "Horovod's other reductions")
        if self.gradient_predivide_factor != 1.0:
            raise ValueError(f"gradient_predivide_factor={self.gradient_predivide_factor!r}: "
                             f"strategy {strategy!r} has no gradient sum to split (the server "
                             "merges fp32 model deltas); leave it at 1.0")
        if self.num_groups or self.groups is not None:
            raise ValueError(f"num_groups={self.num_groups!r}, groups={self.groups!r}: strategy "
                             f"{strategy!r} always sends the whole model in one fused buffer; "
                             "leave them at 0 and None")
        if not on_every_rank(self.process_set):
            raise ValueError(f"process_set={self.process_set!r}: strategy {strategy!r} runs on "
                             "every rank of the job (the global process set) only")

    def check_for_staged_gradients(self) -> None:
        """Strategy "bsp" averaging the gradients through host memory: op Average and the
        global process set."""
        hvd = _horovod()
        why = ("strategy 'bsp' on a CUDA model averages the gradients itself (this Horovod "
               "was built without GPU operations)")
        if self.op is not None and (hvd is None or self.op != hvd.Average):
            raise ValueError(f"op={op_name(self.op)}: {why}, with op=hvd.Average only; build "
                             "Horovod with HOROVOD_GPU_OPERATIONS=NCCL for its other reductions")
        if not on_every_rank(self.process_set):
            raise ValueError(f"process_set={self.process_set!r}: {why}, over every rank of the "
                             "job (the global process set) only")


def on_every_rank(process_set) -> bool:
    """Is `process_set` (None: Horovod's default) the global process set?"""
    return process_set is None or _is_global(process_set, _horovod())


def groups_key(num_groups, groups, optimizer):
    """How Horovod groups the allreduces, comparable between ranks: a number of groups, or
    each group's tensors as their positions among `optimizer`'s parameters, in order (Horovod
    posts a group as one allreduce named after its first tensor)."""
    groups = num_groups if groups is None else groups
    if isinstance(groups, (list, tuple)):
        where = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                                for p in g["params"])}
        return tuple(tuple(where.get(id(t), "not a parameter") for t in group)
                     for group in groups)
    return int(groups)


def _is_global(process_set, hvd) -> bool:
    if hvd is None:
        return False
    from horovod.torch.mpi_ops import global_process_set
    return process_set is global_process_set or getattr(process_set, "process_set_id", None) == 0
