"""The MPI world and the Horovod a strategy runs on, checked once, with errors that say
what to change in the launch or the script."""
from __future__ import annotations

import logging
import os

__all__ = ["mpi_world", "is_mpi", "world_comm", "horovod", "horovod_gpu_operations", "horovod_reduces_on",
           "horovod_staging"]

log = logging.getLogger("ashl")
_said_staged: set = set()


def mpi_world():
    """mpi4py's MPI, after checking the launch gives ashl a real world."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() == 1 and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ:
        raise RuntimeError("ashl needs an MPI launch (horovodrun without --gloo, mpirun, or "
                           "srun --mpi=pmix): under Gloo every rank sees an MPI world of size 1")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("ashl's server thread needs MPI_THREAD_MULTIPLE (mpi4py's default "
                           "request); MPI was initialised with less")
    return MPI


def is_mpi(comm) -> bool:
    """Is `comm` an mpi4py communicator (not a test's in-process fake)?"""
    return type(comm).__module__.startswith("mpi4py")


def world_comm(comm=None, alone: bool = False):
    """The communicator a strategy runs on: COMM_WORLD (COMM_SELF when `alone`: a replacement
    joins a run it was not launched with), or the one given, of a checked MPI launch (a test's
    in-process fake is taken as it is)."""
    if comm is None:
        return mpi_world().COMM_SELF if alone else mpi_world().COMM_WORLD
    if is_mpi(comm):
        mpi_world()
    return comm


def horovod(strategy: str, comm=None):
    """horovod.torch, initialised on the same world as `comm`."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(f"strategy {strategy!r} needs horovod.torch "
                           "(pip install ashl[mpi])") from exc
    if not hvd.is_initialized():
        raise RuntimeError(f"strategy {strategy!r} averages with Horovod: call "
                           "hvd.init(comm=MPI.COMM_WORLD) before creating the optimizer")
    if comm is not None and (hvd.size() != comm.Get_size() or hvd.rank() != comm.Get_rank()):
        raise RuntimeError(f"Horovod's world (rank {hvd.rank()} of {hvd.size()}) is not the "
                           f"communicator's (rank {comm.Get_rank()} of {comm.Get_size()}): "
                           "initialise with hvd.init(comm=MPI.COMM_WORLD)")
    return hvd


# What a Horovod build says of its GPU support, most telling first: 0.28's build defines
# CUDA (ROCm) only when some collective has a GPU operation (HOROVOD_GPU_OPERATIONS=NCCL or
# MPI, a HOROVOD_GPU_<OP>); NCCL's version for a Horovod older than cuda_built().
GPU_BUILT = ("cuda_built", "rocm_built", "nccl_built")


def horovod_gpu_operations(hvd) -> bool:
    """Was this Horovod built with GPU operations (NCCL, CUDA-aware MPI or DDL)? Without
    them its torch ops copy a CUDA tensor to host memory themselves, with no ready event
    (nothing waits for that copy): ashl stages such tensors instead."""
    return any(bool(getattr(hvd, name)()) for name in GPU_BUILT if hasattr(hvd, name))


def horovod_reduces_on(hvd, device, strategy: str) -> bool:
    """Can Horovod's collectives take tensors on `device` as they are? The CPU always; a
    CUDA device only when Horovod was built with GPU operations. When not, the strategy
    stages through pinned host memory, and says so once in the log."""
    if device.type == "cpu" or horovod_gpu_operations(hvd):
        return True
    if strategy not in _said_staged:
        _said_staged.add(strategy)
        log.warning("%s: this Horovod was built without GPU operations: each exchange of the "
                    "%s model is staged through pinned host memory (one copy each way)",
                    strategy, device)
    return False


def horovod_staging(hvd, device, strategy: str):
    """The WireStaging of a strategy whose exchanges are Horovod collectives: none for a
    CPU model (unless ASHL_STAGE_WIRE=1) or a Horovod that reduces on the GPU itself."""
    from ..staging import WireStaging
    on_device = horovod_reduces_on(hvd, device, strategy)
    return WireStaging(device, staged=None if device.type == "cpu" else not on_device)
