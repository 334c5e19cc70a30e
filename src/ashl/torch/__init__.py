"""ashl's PyTorch API, in the style of horovod.torch.

Importing it initialises MPI through mpi4py (as ``from mpi4py import MPI`` does), so that a
script's ``hvd.init()`` finds MPI started and mpi4py, not Horovod, finalises it: at the end
of the interpreter, on the main thread, after every rank has left the run (torch/exit.py).
When Horovod owns MPI, the first rank to shut Horovod down makes every rank's Horovod
background thread finalise MPI at once, under whatever the rank's main thread is still doing.
"""
from mpi4py import MPI as _MPI  # noqa: F401 - see above

from ..compression import Compression
from .evaluation import BackgroundEvaluator
from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .sampler import HeterogeneousSampler

__all__ = ["DistributedOptimizer", "HeterogeneousSampler", "Compression", "BackgroundEvaluator",
           "broadcast_parameters", "broadcast_optimizer_state"]
