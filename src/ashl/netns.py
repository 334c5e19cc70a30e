"""Several hosts on one machine: network namespaces on a private bridge, real shaped links.

    ashl-sw            a namespace holding the bridge ashl-br0 (the "switch")
    ashl-h0..ashl-hN   one namespace per host, eth0 = 10.231.7.(10+i)/24, veth to the switch

Nothing is created in the machine's own network namespace, and only names with the ashl-
prefix and the 10.231.7.0/24 subnet are used. A slow host gets a token-bucket filter (tc tbf)
on both ends of its link: on eth0 inside the host (its uploads) and on its veth in the switch
(its downloads); tbf shapes one direction only. ``hostexec`` (shipped beside this module) runs a
command on a host (its network, own hostname, optionally a private /tmp) and is also Open MPI's
remote shell. Used by the launch tests (tests/cluster/netns.py re-exports this module) and by
``python -m ashl.bench e2e --netns``. Needs root, iproute2 (ip, tc) and util-linux (nsenter,
unshare).
"""
from __future__ import annotations

import atexit
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["PREFIX", "SWITCH", "BRIDGE", "SUBNET", "HOSTEXEC", "address", "skip_reason",
           "hostexec_path", "parse_rate", "format_rate", "Hosts", "hostfile", "mpirun_args",
           "leftover_namespaces", "namespaces_in_use"]

PREFIX = "ashl-h"
SWITCH = "ashl-sw"
BRIDGE = "ashl-br0"
SUBNET = "10.231.7.0/24"
# The remote shell as shipped (package data); hostexec_path() gives an executable copy of it.
HOSTEXEC = Path(__file__).resolve().parent / "hostexec"
MAX_HOSTS = 240   # 10.231.7.10 .. 10.231.7.249


def is_root() -> bool:
    return os.geteuid() == 0


def run(cmd: Sequence, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; on failure raise with that output."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def address(i: int) -> str:
    return f"10.231.7.{10 + i}"


_hostexec_copy: Optional[Path] = None


def hostexec_path() -> Path:
    """An executable hostexec: the packaged file when installed executable, else a copy made
    once per process under /var/tmp (not /tmp: every host may have a private /tmp), removed at
    exit."""
    global _hostexec_copy
    if os.access(HOSTEXEC, os.X_OK):
        return HOSTEXEC
    if _hostexec_copy is None or not _hostexec_copy.exists():
        base = "/var/tmp" if os.path.isdir("/var/tmp") else None
        folder = tempfile.mkdtemp(prefix="ashl-hostexec-", dir=base)
        atexit.register(shutil.rmtree, folder, True)
        path = Path(folder) / "hostexec"
        shutil.copyfile(HOSTEXEC, path)
        path.chmod(0o755)
        _hostexec_copy = path
    return _hostexec_copy


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(bit|kbit|mbit|gbit|tbit)?\s*$", re.I)
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def parse_rate(text: str) -> float:
    """A tc rate in bits ("100mbit", "500kbit", "2gbit", "64000" = bit/s) -> bits per second.
    Only bit units: tc's "bps" means bytes per second, a classic mistake, so it is refused."""
    m = _RATE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a rate in bit/s (e.g. 100mbit, 500kbit, 1gbit)")
    bits = float(m.group(1)) * _UNITS[(m.group(2) or "bit").lower()]
    if not bits >= 8000:
        raise ValueError(f"{text!r}: a link under 8kbit cannot be shaped usefully")
    return bits


def format_rate(bits_per_s: float) -> str:
    """bits per second -> the tc rate text, in whole kbit (e.g. 33333kbit)."""
    return f"{max(8, round(bits_per_s / 1e3))}kbit"


def skip_reason() -> Optional[str]:
    """Why emulated hosts cannot be made here, or None."""
    if not is_root():
        return "network namespaces need root"
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} not found (iproute2 / util-linux)"
    probe = "ashl-probe"
    try:
        run(["ip", "netns", "add", probe])
        run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        run(["ip", "-n", probe, "link", "add", "b0", "type", "bridge"])
        run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1mbit",
             "burst", "32kbit", "latency", "100ms"])
    except Exception as e:  # noqa: BLE001 - any failure means: cannot emulate hosts here
        return f"cannot create network namespaces, veth pairs, bridges or tbf qdiscs: {e}"
    finally:
        run(["ip", "netns", "del", probe], check=False)
    return None


def leftover_namespaces() -> list[str]:
    """Names of ashl-h* / ashl-sw namespaces that exist now (from `ip netns list`)."""
    proc = run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX) or n == SWITCH]


def _ns_id(path: str) -> Optional[tuple[int, int]]:
    """The identity of a network namespace (of /run/netns/NAME or /proc/PID/ns/net)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _pids_in(ids: set) -> list[int]:
    """Processes whose network namespace is one of `ids` (our own process excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and _ns_id(f"/proc/{entry}/ns/net") in ids:
            found.append(int(entry))
    return sorted(found)


def namespaces_in_use() -> dict[str, list[int]]:
    """ashl-h* / ashl-sw namespaces that processes are running in now: {name: pids}. Another
    run (a test, another benchmark) is using the emulated hosts; their names are global."""
    if not os.path.isdir("/run/netns"):
        return {}
    used = {}
    for name in sorted(os.listdir("/run/netns")):
        if name.startswith(PREFIX) or name == SWITCH:
            ident = _ns_id(f"/run/netns/{name}")
            pids = _pids_in({ident}) if ident else []
            if pids:
                used[name] = pids
    return used


@dataclass
class Hosts:
    """N emulated hosts; ``with Hosts(3) as h:`` creates them and always removes them."""
    n: int
    # each host's private /tmp is <tmp_base>/<name> (None: the hosts share this machine's /tmp)
    tmp_base: Optional[str] = None
    names: list[str] = field(default_factory=list)
    shaped: dict[int, str] = field(default_factory=dict)
    # the identity of each namespace we created: one deleted and re-made under the same name by
    # someone else is not ours (its processes are not stopped, it is not deleted)
    created: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self):
        if not 1 <= self.n <= MAX_HOSTS:
            raise ValueError(f"{self.n} hosts: between 1 and {MAX_HOSTS} fit the subnet {SUBNET}")
        self.names = [f"{PREFIX}{i}" for i in range(self.n)]

    @property
    def addresses(self) -> list[str]:
        return [address(i) for i in range(self.n)]

    def create(self) -> "Hosts":
        self.destroy(stale=True)
        try:
            run(["ip", "netns", "add", SWITCH])
            self.created[SWITCH] = _ns_id(f"/run/netns/{SWITCH}")
            run(["ip", "-n", SWITCH, "link", "set", "lo", "up"])
            run(["ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge"])
            run(["ip", "-n", SWITCH, "link", "set", BRIDGE, "up"])
            for i, name in enumerate(self.names):
                run(["ip", "netns", "add", name])
                self.created[name] = _ns_id(f"/run/netns/{name}")
                run(["ip", "-n", name, "link", "set", "lo", "up"])
                # both ends are created inside the namespaces: the machine's own is untouched
                run(["ip", "-n", SWITCH, "link", "add", f"h{i}", "type", "veth",
                     "peer", "name", "eth0", "netns", name])
                run(["ip", "-n", SWITCH, "link", "set", f"h{i}", "master", BRIDGE, "up"])
                run(["ip", "-n", name, "addr", "add", f"{address(i)}/24", "dev", "eth0"])
                run(["ip", "-n", name, "link", "set", "eth0", "up"])
        except BaseException:
            self.destroy()
            raise
        return self

    def shape(self, i: int, rate: str, burst: str = "16kb", latency: str = "400ms") -> None:
        """Throttle host i's link to `rate` (tc syntax, e.g. "4mbit") in both directions."""
        for ns, dev in ((self.names[i], "eth0"), (SWITCH, f"h{i}")):
            run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                 "burst", burst, "latency", latency])
        self.shaped[i] = rate

    def unshape(self, i: int) -> None:
        for ns, dev in ((self.names[i], "eth0"), (SWITCH, f"h{i}")):
            run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
        self.shaped.pop(i, None)

    def qdiscs(self) -> str:
        out = [run(["tc", "-n", ns, "qdisc", "show"], check=False).stdout
               for ns in [SWITCH, *self.names]]
        return "".join(out)

    def command(self, i: int, argv) -> list[str]:
        """The command line that runs argv on host i (hostexec quotes like ssh)."""
        env = []
        if self.tmp_base:
            env = [f"ASHL_HOSTS_TMP={self.tmp_base}", f"ASHL_HOSTS_KEEP={':'.join(_keep_paths())}"]
        return ["env", *env, str(hostexec_path()), self.names[i], shlex.join(map(str, argv))]

    def pids(self) -> list[int]:
        """Processes still running inside any of the hosts this object created."""
        ids = {self.created[n] for n in self.names if self.created.get(n)}
        return _pids_in(ids) if ids else []

    def stop_processes(self, grace: float = 3.0) -> list[int]:
        """SIGTERM, then SIGKILL, every process left inside our hosts (ranks of a launcher that
        was killed): a namespace whose name is deleted lives on while a process is in it.
        Returns the pids it found."""
        first = self.pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = self.pids()
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = self.pids()
            if not left:
                break
        return first

    def destroy(self, stale: bool = False) -> None:
        """Delete the namespaces (with them their links, bridge and qdiscs). With stale=True,
        also any ashl-h*/ashl-sw left by an earlier run that died."""
        names = [SWITCH, *self.names]
        if stale and os.path.isdir("/run/netns"):
            names += [n for n in os.listdir("/run/netns")
                      if (n.startswith(PREFIX) or n == SWITCH) and n not in names]
        for name in names:
            path = f"/run/netns/{name}"
            if not os.path.exists(path):
                continue
            # after create(): only the namespaces it made (not one re-made by someone else)
            if not stale and self.created and _ns_id(path) != self.created.get(name):
                continue
            run(["ip", "netns", "del", name], check=False)
        self.created.clear()
        self.shaped.clear()

    def __enter__(self) -> "Hosts":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()


def hostfile(hosts: Hosts, path: str, slots: int = 1) -> str:
    """An Open MPI hostfile of the hosts (the format of hostfile.example, comments included)."""
    with open(path, "w") as f:
        f.write("# emulated hosts: network namespaces on one bridge\n")
        for name, addr in zip(hosts.names, hosts.addresses):
            f.write(f"{addr} slots={slots}    # {name}\n")
    return path


def mpirun_args(hosts: Hosts, slots: int = 1, hostfile_path: Optional[str] = None) -> list[str]:
    """mpirun options for a job across the emulated hosts (run mpirun on host 0)."""
    where = (["--hostfile", hostfile_path] if hostfile_path else
             ["-H", ",".join(f"{a}:{slots}" for a in hosts.addresses)])
    return [*where,
            "--mca", "plm_rsh_agent", str(hostexec_path()),
            "--mca", "btl", "tcp,self",
            "--mca", "btl_tcp_if_include", SUBNET,
            "--mca", "oob_tcp_if_include", SUBNET,
            "--bind-to", "none"]


def _keep_paths() -> list[str]:
    """What a host with a private /tmp must still see if it lives under /tmp: this checkout
    (or installed package), the Python environment, and the working directory."""
    import ashl
    package = os.path.dirname(os.path.dirname(os.path.abspath(ashl.__file__)))
    candidates = [os.path.dirname(package) if package.endswith("/src") else package,
                  sys.prefix, os.getcwd()]
    keep = []
    for path in candidates:
        parts = os.path.realpath(path).split(os.sep)
        if len(parts) > 2 and parts[1] == "tmp":
            top = os.sep.join(parts[:3])   # /tmp/<entry>: bind the whole top-level entry
            if top not in keep:
                keep.append(top)
    return keep
