import os

from hypothesis import HealthCheck, settings

# Shared 2-core CI machines are slow and noisy: no per-example deadlines.
settings.register_profile("ashl", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ashl"))

# Fixtures of the launch tests (Slurm daemons, emulated hosts): tests/cluster/fixtures.py
from cluster.fixtures import hosts3, munge, slurm_hosts3, slurm_installed, slurm_local  # noqa: E402,F401
