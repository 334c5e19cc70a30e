"""pytest fixtures for the launch tests: munged, a one-node Slurm, emulated hosts, a 3-node Slurm.

Each installs what it needs (apt, as root) or skips with the reason, and a finalizer stops every
daemon and removes every namespace it created, whether the test passed or not.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from . import netns, slurm


@pytest.fixture(scope="session")
def slurm_installed():
    reason = slurm.ensure_installed()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def munge(slurm_installed):
    m = slurm.Munge()
    try:
        m.start()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cannot start munged: {e}")
    yield m
    m.stop()


@pytest.fixture(scope="module")
def slurm_local(munge, tmp_path_factory):
    """slurmctld + slurmd on this machine (loopback), all of its CPUs in partition 'ashl'."""
    cluster = slurm.Cluster(tmp_path_factory.mktemp("slurm"), [slurm.local_node()],
                            name="ashl-local", ctld_port=16817, slurmd_port=16818)
    cluster.start()
    yield cluster
    cluster.stop()


def _work_dir(prefix: str) -> str:
    # Not under /tmp: every emulated host gets its own /tmp, and results must be seen by all.
    return tempfile.mkdtemp(prefix=prefix, dir="/var/tmp" if os.path.isdir("/var/tmp") else None)


@pytest.fixture(scope="module")
def hosts3():
    """Three emulated hosts ashl-h0..h2 (10.231.7.10-12) on one bridge, links unshaped."""
    reason = netns.skip_reason()
    if reason:
        pytest.skip(reason)
    work = _work_dir("ashl-hosts-")
    hosts = netns.Hosts(3, tmp_base=os.path.join(work, "tmp"))
    hosts.work = work
    try:
        hosts.create()
        yield hosts
    finally:
        hosts.destroy()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm_hosts3(munge, hosts3):
    """A 3-node Slurm across the emulated hosts: slurmctld on ashl-h0, a slurmd on each, every
    daemon in its host's network namespace with its own hostname and /tmp."""
    work = os.path.join(hosts3.work, "slurm")
    os.makedirs(work, exist_ok=True)
    nodes = [slurm.Node(name, netns.address(i), cpus=1,
                        on=lambda argv, i=i: hosts3.command(i, argv))
             for i, name in enumerate(hosts3.names)]
    cluster = slurm.Cluster(work, nodes, name="ashl-hosts", ctld_port=16817, slurmd_port=16818)
    cluster.start()
    yield cluster
    cluster.stop()
