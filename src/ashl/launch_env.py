"""The environment for launching an MPI job from a process that is itself part of one (an
mpirun rank, or a process that initialised MPI as a singleton, as mpi4py does on import).

Open MPI and PMIx leave their own launch variables in such a process's C environment; a
nested mpirun that inherits them believes it already runs inside a job and exits at once with
status 1 and no message. They are dropped; everything else (OMPI_MCA_btl_*, the root
permissions, the user's own settings) is kept.
"""
from __future__ import annotations

import os
import subprocess
from typing import Mapping, Optional

_LAUNCH_PREFIXES = ("PMIX_", "ORTE_", "OMPI_COMM_WORLD_", "OMPI_APP_CTX_", "OMPI_MCA_orte_",
                    "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_FIRST_RANKS", "OMPI_UNIVERSE_SIZE",
                    "OMPI_NUM_APP_CTX", "OMPI_FILE_LOCATION", "OMPI_MCA_initial_wdir",
                    "OMPI_COMMAND", "OMPI_ARGV", "OMPI_MCA_shmem_RUNTIME_QUERY_hint")


def current_environ() -> dict:
    """This process's C-level environment (os.environ misses what MPI_Init set)."""
    out = subprocess.run(["env", "-0"], capture_output=True, check=True).stdout
    pairs = (item.split(b"=", 1) for item in out.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def launch_env(base: Optional[Mapping[str, str]] = None, **extra: str) -> dict:
    """`base` (default: the C-level environment) without MPI's own launch variables, plus
    `extra`."""
    env = dict(current_environ() if base is None else base)
    for key in [k for k in env if k.startswith(_LAUNCH_PREFIXES)]:
        del env[key]
    env.update(extra)
    return env
