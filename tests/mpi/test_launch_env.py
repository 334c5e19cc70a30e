"""A process that initialised MPI (mpi4py's import does) must still be able to launch mpirun."""
import os
import subprocess
import sys

from ashl.launch_env import launch_env


def test_singleton_launch_variables_are_dropped_and_the_rest_kept():
    env = launch_env({"PMIX_RANK": "0", "OMPI_MCA_ess": "singleton", "ORTE_SCHIZO_DETECTION": "x",
                      "OMPI_MCA_btl": "tcp,self", "OMPI_ALLOW_RUN_AS_ROOT": "1", "PATH": "/bin"},
                     EXTRA="1")
    assert env == {"OMPI_MCA_btl": "tcp,self", "OMPI_ALLOW_RUN_AS_ROOT": "1", "PATH": "/bin",
                   "EXTRA": "1"}


SCRIPT = """
import subprocess, sys
from mpi4py import MPI          # a singleton MPI_Init: Open MPI sets its launch variables
from ashl.launch_env import launch_env
env = launch_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
p = subprocess.run(["mpirun", "-np", "1", "--oversubscribe", "hostname"], env=env,
                   capture_output=True, text=True, timeout=60)
print("rc", p.returncode)
"""


def test_mpirun_from_an_mpi_initialised_process():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rc 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
