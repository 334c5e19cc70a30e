"""Which device a rank trains on: one GPU per rank, the rank's local rank choosing it.

    --device auto     cuda:<local rank mod GPUs> when this host has a GPU, else cpu
    --device cuda     the same GPU, and an error when the host has none
    --device cuda:N   that GPU (N below the host's count)
    --device cpu

The local rank is the launcher's (Open MPI, PMIx, MPICH/Hydra, MVAPICH, horovodrun's Gloo,
torchrun, Slurm's srun): ranks sharing a host take different GPUs, and share them
round-robin when there are more ranks than GPUs. The variable of the launcher that started
the ranks comes first: ``mpirun`` inside a Slurm allocation leaves the batch step's
SLURM_LOCALID in every rank (the same on all), so Slurm's comes last. Once MPI runs, the
ranks of a shared-memory communicator say it exactly (``pick_device(spec, comm)``). A
model's strategy then takes the device from the model (``model_device``).
"""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional, Sequence

__all__ = ["LOCAL_RANK_VARS", "DEVICE_CHOICES", "local_rank", "host_rank", "check_device_spec",
           "resolve_device", "pick_device", "model_device"]

# The MPI launchers' first, Slurm's last (module docstring).
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK", "MPI_LOCALRANKID",
                   "MV2_COMM_WORLD_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "LOCAL_RANK",
                   "SLURM_LOCALID")
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_SPEC = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")


def local_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank among the ranks of its host, from the launcher (0 alone)."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARS:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def host_rank(comm) -> int:
    """This rank's rank among the ranks of `comm` that share its memory (its host):
    collective over `comm`."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def check_device_spec(spec: str) -> str:
    """`spec` if it is one of DEVICE_CHOICES, else a ValueError naming it."""
    m = _SPEC.match(str(spec).strip().lower())
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"device {spec!r}: expected {DEVICE_CHOICES}")
    return m.group(0)


def resolve_device(spec: str, cuda_count: int, rank_on_host: int) -> str:
    """The device `spec` means on a host with `cuda_count` GPUs for local rank
    `rank_on_host` (pure: the parts a launch decides are arguments)."""
    spec = check_device_spec(spec)
    if spec == "cpu" or (spec == "auto" and cuda_count == 0):
        return "cpu"
    if cuda_count == 0:
        raise ValueError(f"device {spec!r}: this host has no CUDA device (torch sees none); "
                         "use --device cpu or auto")
    if spec.startswith("cuda:"):
        index = int(spec.split(":")[1])
        if index >= cuda_count:
            raise ValueError(f"device {spec!r}: this host has {cuda_count} CUDA device"
                             f"{'s' if cuda_count != 1 else ''} (0 to {cuda_count - 1})")
        return spec
    return f"cuda:{rank_on_host % cuda_count}"


def pick_device(spec: str = "auto", comm=None):
    """The torch.device `spec` means for this rank, here. With `comm` (an mpi4py
    communicator; collective over it) the local rank is MPI's, else the launcher's."""
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rank_on_host = local_rank() if comm is None else host_rank(comm)
    return torch.device(resolve_device(spec, count, rank_on_host))


def model_device(tensors: Sequence):
    """The one device a model's tensors live on (CPU for no tensors); a model spread over
    several devices is refused: one GPU per rank."""
    import torch
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"the model's tensors are on {sorted(map(str, devices))}: ashl trains "
                         "on one device per rank (move the whole model with model.to(device))")
    device = next(iter(devices), torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the model is on {device}: ashl trains on cpu or cuda devices")
    return device
