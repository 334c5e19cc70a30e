"""The suite is grouped by what a test needs, and marked by its folder:

    tests/unit     pure logic and single-process code (kernels, planner, server, protocol)
    tests/mpi      real ranks under mpirun / horovodrun (marker ``mpi``)
    tests/cluster  real launchers and hosts: Slurm, network-namespace hosts (``cluster``)
    tests/cuda     needs a CUDA device (``cuda``; skipped without one)

so ``pytest -m "not mpi and not cluster"`` runs the quick part alone.
"""
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Shared 2-core CI machines are slow and noisy: no per-example deadlines.
settings.register_profile("ashl", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ashl"))

# Fixtures of the launch tests (Slurm daemons, emulated hosts): tests/cluster/fixtures.py
from cluster.fixtures import hosts3, munge, slurm_hosts3, slurm_installed, slurm_local  # noqa: E402,F401

_HERE = Path(__file__).resolve().parent
_FOLDER_MARKS = {"mpi": ("mpi", "slow"), "cluster": ("cluster", "slow"), "cuda": ("cuda",)}


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = Path(str(item.fspath)).resolve().relative_to(_HERE).parts[0]
        except ValueError:
            continue
        for mark in _FOLDER_MARKS.get(folder, ()):
            item.add_marker(getattr(pytest.mark, mark))
