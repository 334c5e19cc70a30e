"""ashl: heterogeneity-aware distributed training for PyTorch, as a Horovod extension.

Submodules load lazily so the pure parts (``ashl.planner``) import without torch.
"""
import importlib

__version__ = "0.1.0"

_SUBMODULES = {"kernels", "planner", "profiler", "coordinator", "stages", "emulation", "bench",
               "protocol", "compression", "data", "models", "torch"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
