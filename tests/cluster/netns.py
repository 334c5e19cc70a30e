"""Several hosts on one machine: network namespaces on a private bridge, real shaped links.

    ashl-sw            a namespace holding the bridge ashl-br0 (the "switch")
    ashl-h0..ashl-hN   one namespace per host, eth0 = 10.231.7.(10+i)/24, veth to the switch

Nothing is created in the machine's own network namespace, and only names with the ashl-
prefix and the 10.231.7.0/24 subnet are used. A slow host gets a token-bucket filter (tc tbf)
on both ends of its link: on eth0 inside the host (its uploads) and on its veth in the switch
(its downloads); tbf shapes one direction only. ``hostexec`` runs a command on a host (its
network, own hostname, optionally a private /tmp) and is also Open MPI's remote shell.
"""
from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .system import is_root, run

PREFIX = "ashl-h"
SWITCH = "ashl-sw"
BRIDGE = "ashl-br0"
SUBNET = "10.231.7.0/24"
HOSTEXEC = Path(__file__).resolve().parent / "hostexec"


def address(i: int) -> str:
    return f"10.231.7.{10 + i}"


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


@dataclass
class Hosts:
    """N emulated hosts; ``with Hosts(3) as h:`` creates them and always removes them."""
    n: int
    # each host's private /tmp is <tmp_base>/<name> (None: the hosts share this machine's /tmp)
    tmp_base: Optional[str] = None
    names: list[str] = field(default_factory=list)
    shaped: dict[int, str] = field(default_factory=dict)

    def __post_init__(self):
        self.names = [f"{PREFIX}{i}" for i in range(self.n)]

    @property
    def addresses(self) -> list[str]:
        return [address(i) for i in range(self.n)]

    def create(self) -> "Hosts":
        self.destroy(stale=True)
        try:
            run(["ip", "netns", "add", SWITCH])
            run(["ip", "-n", SWITCH, "link", "set", "lo", "up"])
            run(["ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge"])
            run(["ip", "-n", SWITCH, "link", "set", BRIDGE, "up"])
            for i, name in enumerate(self.names):
                run(["ip", "netns", "add", name])
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
        env = [f"ASHL_HOSTS_TMP={self.tmp_base}"] if self.tmp_base else []
        return ["env", *env, str(HOSTEXEC), self.names[i], shlex.join(map(str, argv))]

    def destroy(self, stale: bool = False) -> None:
        """Delete the namespaces (with them their links, bridge and qdiscs). With stale=True,
        also any ashl-h*/ashl-sw left by an earlier run that died."""
        names = [SWITCH, *self.names]
        if stale and os.path.isdir("/run/netns"):
            names += [n for n in os.listdir("/run/netns")
                      if (n.startswith(PREFIX) or n == SWITCH) and n not in names]
        for name in names:
            if os.path.exists(f"/run/netns/{name}"):
                run(["ip", "netns", "del", name], check=False)
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
            "--mca", "plm_rsh_agent", str(HOSTEXEC),
            "--mca", "btl", "tcp,self",
            "--mca", "btl_tcp_if_include", SUBNET,
            "--mca", "oob_tcp_if_include", SUBNET,
            "--bind-to", "none"]
