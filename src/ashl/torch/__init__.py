"""ashl's PyTorch API, in the style of horovod.torch."""
from ..compression import Compression
from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .sampler import HeterogeneousSampler

__all__ = ["DistributedOptimizer", "HeterogeneousSampler", "Compression",
           "broadcast_parameters", "broadcast_optimizer_state"]
