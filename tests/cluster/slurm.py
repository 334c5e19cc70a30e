"""A real Slurm (Debian's slurm-wlm 22.05 and munge) started and stopped by the tests.

``ensure_installed()`` apt-installs slurm-wlm and munge when they are missing (root only).
``Munge`` runs munged as the munge user (it refuses root) unless one is already running.
``Cluster`` writes a slurm.conf into a work directory, starts slurmctld and one slurmd per node
(on this machine, or each inside an emulated host of tests/cluster/netns.py), waits until every
node is idle, runs client commands (sbatch, srun, sinfo) against it, and stops every daemon it
started. No accounting, no cgroups: proctrack/linuxproc, task/none, select/cons_tres.
"""
from __future__ import annotations

import os
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from .system import apt_install, is_root, run, stop_pid, stop_process, wait_for

PACKAGES = ["slurm-wlm", "munge"]
COMMANDS = ["sbatch", "srun", "sinfo", "scontrol", "/usr/sbin/slurmctld", "/usr/sbin/slurmd",
            "/usr/sbin/munged", "munge", "unmunge"]
MUNGE_SOCKET = "/run/munge/munge.socket.2"
# pids of the daemons the tests started, so that a run killed before its finalizers (SIGKILL,
# a lost CI job) does not leave slurmctld holding the ports for the next one
REGISTRY = Path("/run/ashl-tests/daemons")


def ensure_installed() -> Optional[str]:
    """None when Slurm and munge are usable here (installing them if needed), else why not."""
    if not is_root():
        return "starting Slurm daemons (SlurmUser=root) needs root"
    reason = apt_install(PACKAGES, COMMANDS)
    if reason:
        return reason
    if not Path("/etc/munge/munge.key").exists():
        try:
            run(["runuser", "-u", "munge", "--", "/usr/sbin/mungekey", "--verbose"])
        except Exception as e:  # noqa: BLE001
            return f"no /etc/munge/munge.key and mungekey failed: {e}"
    return None


def _munge_works() -> bool:
    if not os.path.exists(MUNGE_SOCKET):
        return False
    cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if cred.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True,
                          timeout=10).returncode == 0


class Munge:
    """munged for the tests: reuses a running one, else starts (and later stops) its own."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "Munge":
        if _munge_works():
            return self
        import pwd
        pw = pwd.getpwnam("munge")
        for d in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
            os.makedirs(d, exist_ok=True)
            os.chown(d, pw.pw_uid, pw.pw_gid)
        os.chmod("/run/munge", 0o755)
        # munged refuses to run as root; as the munge user it needs nothing else
        self.proc = subprocess.Popen(["/usr/sbin/munged", "--foreground", "--force"],
                                     user=pw.pw_uid, group=pw.pw_gid, extra_groups=[],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for(lambda: self.proc.poll() is not None or _munge_works(), 15, "munged")
        except TimeoutError:
            self.stop()
            raise
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode(errors="replace")
            self.proc = None
            raise RuntimeError(f"munged exited at once: {err}")
        return self

    @property
    def started_here(self) -> bool:
        return self.proc is not None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


@dataclass
class Node:
    name: str
    addr: str
    cpus: int = 1
    # turns an argv into the command line that runs it on this node (identity: this machine)
    on: Callable[[Sequence[str]], list[str]] = lambda argv: list(map(str, argv))


def local_node(cpus: Optional[int] = None) -> Node:
    """This machine as a one-node cluster on the loopback address."""
    return Node(socket.gethostname().split(".")[0], "127.0.0.1", cpus or os.cpu_count() or 1)


class Cluster:
    """slurmctld on nodes[0] and a slurmd on every node; ``with Cluster(...) as c:``."""

    def __init__(self, workdir: os.PathLike, nodes: Sequence[Node], name: str = "ashl",
                 ctld_port: int = 16817, slurmd_port: int = 16818, extra_conf: str = ""):
        self.dir = Path(workdir)
        self.nodes = list(nodes)
        self.name = name
        self.ctld_port, self.slurmd_port = ctld_port, slurmd_port
        self.extra_conf = extra_conf
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.pidfiles: list[Path] = []

    # -- configuration ---------------------------------------------------------------------
    def write_conf(self) -> None:
        d = self.dir
        for sub in ("state", "log", *(f"spool-{n.name}" for n in self.nodes)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        ctl = self.nodes[0]
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={ctl.name}({ctl.addr})",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool-%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=300",
            "SchedulerParameters=sched_interval=1",
            self.extra_conf,
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} "
                         f"CPUs={n.cpus} State=UNKNOWN")
        lines.append("PartitionName=ashl Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                     "OverSubscribe=YES")
        self.conf.write_text("\n".join(lines) + "\n")

    @property
    def env(self) -> dict:
        """Environment for client commands (and jobs: sbatch exports it)."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    # -- daemons ---------------------------------------------------------------------------
    def _daemon(self, node: Node, argv: Sequence[str], log: str, pidfile: Path) -> None:
        self.pidfiles.append(pidfile)
        out = open(self.dir / "log" / log, "ab")
        self.procs.append(subprocess.Popen(node.on(argv), stdout=out, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True))
        out.close()

    @staticmethod
    def _cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""

    def _register(self, pid: int) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / str(pid)).write_bytes(self._cmdline(pid))

    @staticmethod
    def stop_stale() -> None:
        """Stop daemons an earlier test run started and never stopped (same pid, same command
        line as recorded), then forget them."""
        if not REGISTRY.is_dir():
            return
        for entry in REGISTRY.iterdir():
            try:
                pid = int(entry.name)
            except ValueError:
                continue
            recorded = entry.read_bytes()
            if recorded and Cluster._cmdline(pid) == recorded:
                stop_pid(pid)
            entry.unlink(missing_ok=True)

    def start(self, timeout: float = 45) -> "Cluster":
        self.stop_stale()
        self.write_conf()
        try:
            ctl = self.nodes[0]
            self._daemon(ctl, ["/usr/sbin/slurmctld", "-D", "-i", "-f", self.conf],
                         "slurmctld.out", self.dir / "slurmctld.pid")
            wait_for(lambda: self._client(ctl, ["scontrol", "ping"]).stdout.count("UP") >= 1
                     or self._dead(), timeout, "slurmctld to answer")
            for n in self.nodes:
                self._daemon(n, ["/usr/sbin/slurmd", "-D", "-N", n.name, "-f", self.conf],
                             f"slurmd-{n.name}.out", self.dir / f"slurmd-{n.name}.pid")
            wait_for(lambda: self._all_idle() or self._dead(), timeout, "every node to be idle")
            for pidfile in self.pidfiles:
                self._register(int(pidfile.read_text().split()[0]))
            if self._dead():
                raise RuntimeError(f"a Slurm daemon exited:\n{self.logs()}")
        except BaseException as e:
            logs = self.logs()
            self.stop()
            if isinstance(e, TimeoutError):
                raise TimeoutError(f"{e}\n{logs}") from None
            raise
        return self

    def _dead(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def _all_idle(self) -> bool:
        out = self.client(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n.name, "").startswith("idle") for n in self.nodes)

    def _client(self, node: Node, argv: Sequence[str], timeout: float = 30,
                env: Optional[dict] = None) -> subprocess.CompletedProcess:
        return subprocess.run(node.on(argv), capture_output=True, text=True, timeout=timeout,
                              env=env or self.env)

    def client(self, argv: Sequence[str], timeout: float = 30, env: Optional[dict] = None,
               cwd: Optional[os.PathLike] = None) -> subprocess.CompletedProcess:
        """Run a Slurm client command on the controller's node (the login node)."""
        node = self.nodes[0]
        if cwd is not None:  # hostexec runs a shell: cd there first
            argv = ["sh", "-c", f"cd {shlex.quote(str(cwd))} && exec {shlex.join(map(str, argv))}"]
        return subprocess.run(node.on(argv), capture_output=True, text=True, timeout=timeout,
                              env=env or self.env)

    def sbatch_wait(self, argv: Sequence[str], timeout: float, env: Optional[dict] = None,
                    cwd: Optional[os.PathLike] = None) -> subprocess.CompletedProcess:
        return self.client(["sbatch", "--wait", *argv], timeout=timeout, env=env, cwd=cwd)

    TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE")

    def sbatch_poll(self, argv: Sequence[str], timeout: float, env: Optional[dict] = None,
                    cwd: Optional[os.PathLike] = None, interval: float = 0.5) -> dict:
        """Submit with sbatch --parsable and poll scontrol until the job ends; its fields.

        sbatch --wait polls after 2, 10, 42, 74, ... s (its sleep grows to 32 s), which costs up
        to half a minute per job; this returns within `interval` of the job's end."""
        proc = self.client(["sbatch", "--parsable", *argv], timeout=30, env=env, cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed: {proc.stdout}{proc.stderr}")
        job = proc.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while True:
            out = self.client(["scontrol", "show", "job", "-o", job], env=env).stdout
            fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
            if fields.get("JobState") in self.TERMINAL:
                return fields
            if time.monotonic() > deadline:
                self.client(["scancel", job], env=env)
                raise TimeoutError(f"job {job} still {fields.get('JobState')} "
                                   f"({fields.get('Reason')}) after {timeout} s")
            time.sleep(interval)

    def logs(self, tail: int = 2500) -> str:
        parts = []
        logdir = self.dir / "log"
        if logdir.exists():
            for f in sorted(logdir.iterdir()):
                text = f.read_text(errors="replace")
                if text.strip():
                    parts.append(f"--- {f.name}\n{text[-tail:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop every daemon this cluster started: by the pid each wrote, then by our child."""
        for pidfile in reversed(self.pidfiles):
            try:
                pid = int(pidfile.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            stop_pid(pid)
            (REGISTRY / str(pid)).unlink(missing_ok=True)
        for p in reversed(self.procs):
            stop_process(p)
        self.procs.clear()
        self.pidfiles.clear()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
