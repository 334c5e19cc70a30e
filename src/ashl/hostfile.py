"""Open MPI hostfiles, checked before a launch: ``host [slots=N] [max_slots=N]`` per line,
``#`` comments. A bad file is named with its line, instead of failing inside mpirun.

    python -m ashl.hostfile hostfile.example     # prints the hosts, or one error line (exit 2)
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Optional

_HOST = re.compile(r"^[A-Za-z0-9_.:\-\[\]]+$")


class HostfileError(ValueError):
    pass


@dataclass(frozen=True)
class Host:
    name: str
    slots: int = 1
    max_slots: Optional[int] = None


def parse_hostfile(path: str) -> list[Host]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise HostfileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    hosts: list[Host] = []
    seen = set()
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *fields = line.split()
        where = f"{path}:{number}"
        if not _HOST.match(name) or "=" in name:
            raise HostfileError(f"{where}: {name!r} is not a host name or address")
        if name in seen:
            raise HostfileError(f"{where}: host {name!r} is listed twice")
        seen.add(name)
        values = {}
        for field in fields:
            key, sep, value = field.partition("=")
            key = key.strip().lower().replace("-", "_")
            if not sep or key not in ("slots", "max_slots", "count", "cpu"):
                raise HostfileError(f"{where}: {field!r} is not slots=N or max_slots=N")
            if not value.isdigit() or int(value) < 1:
                raise HostfileError(f"{where}: {key} must be a whole number >= 1, got {value!r}")
            values["slots" if key in ("count", "cpu") else key] = int(value)
        slots = values.get("slots", 1)
        cap = values.get("max_slots")
        if cap is not None and cap < slots:
            raise HostfileError(f"{where}: max_slots={cap} is below slots={slots}")
        hosts.append(Host(name, slots, cap))
    if not hosts:
        raise HostfileError(f"{path}: no hosts")
    return hosts


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ashl.hostfile HOSTFILE", file=sys.stderr)
        return 2
    try:
        hosts = parse_hostfile(args[0])
    except HostfileError as exc:
        print(f"ashl.hostfile: error: {exc}", file=sys.stderr)
        return 2
    for h in hosts:
        cap = f" max_slots={h.max_slots}" if h.max_slots else ""
        print(f"{h.name} slots={h.slots}{cap}")
    print(f"{len(hosts)} hosts, {sum(h.slots for h in hosts)} slots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
