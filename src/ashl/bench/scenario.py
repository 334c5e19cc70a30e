"""The default benchmark scenario: what an emulated cluster must look like to stand for a real one.

A user training ResNet-18 on V100s over 10 Gbit/s Ethernet pays about as much to move the
model once as to compute one step. The benchmark keeps that ratio for its own model: with
GPU-like steps of S seconds (``--step-time``), the factor-1 link moves the model's bytes in
``COMM_COMPUTE_RATIO x S``. The arithmetic, in one place:

    ResNet-18 (CIFAR)   11,173,962 parameters x 4 B            = 44.7 MB per transfer
    10 Gbit/s           1.25 GB/s                     -> 44.7 / 1.25 = 35.8 ms per transfer
    V100 step           batch 128 x 3.34 GFLOP (forward + backward, 3 x 1.11 GFLOP forward)
                        = 427 GFLOP at 55% of 15.7 TFLOP/s (fp32)       = 49.5 ms per step
    ratio               35.8 / 49.5                                     = 0.72

The step time is an estimate (FLOPs at a typical cuDNN efficiency, about 2,600 images/s),
not a measurement; the ratio is what the benchmark reproduces.
"""
from __future__ import annotations

from ..emulation import Link

RESNET18_BYTES = 11_173_962 * 4
TEN_GBIT_BYTES_PER_S = 10e9 / 8
V100_RESNET18_STEP_S = 128 * 3 * 1.11e9 / (0.55 * 15.7e12)
COMM_COMPUTE_RATIO = (RESNET18_BYTES / TEN_GBIT_BYTES_PER_S) / V100_RESNET18_STEP_S
LINK_LATENCY_S = 5e-4      # a datacentre Ethernet hop, as DEFAULT_LINK

# The scenario itself (python -m ashl.bench e2e with no options).
MODEL, DATASET = "mnistnet", "mnist"
# A factor-1 rank's step (8-10 ms of it is this machine's real work): long enough that
# every strategy takes 30-120 s to the target, so start-up cannot decide a ranking.
STEP_TIME_S = 0.20
TARGET_ACCURACY = 0.97
MAX_SECONDS = 240.0
EVAL_EVERY_S = 1.0


def matched_link(model_bytes: int, step_s: float, ratio: float = COMM_COMPUTE_RATIO,
                 latency_s: float = LINK_LATENCY_S) -> Link:
    """The factor-1 link that moves `model_bytes` in `ratio` x `step_s` (plus its latency)."""
    if not model_bytes > 0:
        raise ValueError(f"model_bytes must be > 0, got {model_bytes!r}")
    if not (step_s > 0 and ratio > 0):
        raise ValueError(f"step_s and ratio must be > 0, got {step_s!r} and {ratio!r}")
    return Link(latency_s, model_bytes / (ratio * step_s))


def model_bytes(model: str, dataset: str) -> int:
    """The fp32 size of `model` built for `dataset` (what one dense commit moves)."""
    from ..cli import check_dataset_spec
    from ..models import build_model, num_parameters
    shape = check_dataset_spec(dataset, must_exist=False)
    return 4 * num_parameters(build_model(model, shape, 10))
