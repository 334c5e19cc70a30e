"""Rank, size and local rank as Horovod and MPI read them, under every launcher users have:
mpirun, horovodrun, srun --mpi=pmix in a real Slurm allocation, and mpirun across emulated hosts."""
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import netns
from cluster.launch import (RANK_INFO, VENV_BIN, check_world, job_env, rank_infos,
                            read_rank_files, subnet_env)

sys.path.insert(0, str(RANK_INFO.parents[1] / "mpi"))
from _util import skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120),
              pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))]


def launch(cmd, out_dir, size, env=None, timeout=90):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          env=env or job_env(), timeout=timeout)
    assert proc.returncode == 0, f"{cmd[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return read_rank_files(out_dir, size)


def test_mpirun(tmp_path):
    infos = launch(["mpirun", "-np", 2, "--bind-to", "none", sys.executable, RANK_INFO, tmp_path],
                   tmp_path, 2)
    check_world(infos, size=2, per_host=2)
    assert [i["env"]["OMPI_COMM_WORLD_LOCAL_RANK"] for i in infos] == ["0", "1"]


def test_horovodrun(tmp_path):
    infos = launch([VENV_BIN / "horovodrun", "-np", 2, "-H", "localhost:2",
                    sys.executable, RANK_INFO, tmp_path], tmp_path, 2)
    check_world(infos, size=2, per_host=2)
    assert all("HOROVOD_RANK" not in i["env"] for i in infos)  # an MPI launch, not Gloo's


def test_srun_pmix(slurm_local, tmp_path):
    proc = slurm_local.client(["srun", "--mpi=pmix", "-n", 2, sys.executable, RANK_INFO, tmp_path],
                              env=job_env(slurm_local.env), timeout=90)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{slurm_local.logs()}"
    infos = read_rank_files(tmp_path, 2)
    check_world(infos, size=2, per_host=2)
    assert [i["env"]["SLURM_PROCID"] for i in infos] == ["0", "1"]
    assert [i["env"]["SLURM_LOCALID"] for i in infos] == ["0", "1"]


@pytest.mark.parametrize("mpi", [None, "pmi2"])
def test_srun_without_pmix_is_refused_by_open_mpi(slurm_local, mpi):
    """Why the batch script says --mpi=pmix: this Open MPI is built without Slurm's PMI, so
    under plain srun or --mpi=pmi2 MPI_Init aborts (asking for PMI support) instead of forming
    a world."""
    plugin = [f"--mpi={mpi}"] if mpi else []
    proc = slurm_local.client(["srun", *plugin, "-n", 2, sys.executable, RANK_INFO],
                              env=job_env(slurm_local.env), timeout=90)
    assert proc.returncode != 0
    assert "PMI" in proc.stdout + proc.stderr
    assert rank_infos(proc.stdout) == []


def test_mpirun_across_hosts(hosts3):
    """One rank on each of three emulated hosts: local rank 0 everywhere, cross rank = rank.
    The hosts come from a hostfile in hostfile.example's format."""
    hostfile = netns.hostfile(hosts3, f"{hosts3.work}/hostfile")
    out = Path(hosts3.work) / "ranks"   # not /tmp: every host has its own
    out.mkdir(exist_ok=True)
    cmd = ["mpirun", "-np", 3, *netns.mpirun_args(hosts3, hostfile_path=hostfile),
           sys.executable, RANK_INFO, out]
    infos = launch(hosts3.command(0, cmd), out, 3, env=job_env(**subnet_env(netns.SUBNET)))
    check_world(infos, size=3, per_host=1)
    assert [i["host"] for i in infos] == hosts3.names
    assert [i["hvd"]["cross_rank"] for i in infos] == [0, 1, 2]
