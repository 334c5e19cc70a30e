"""``python -m ashl.run LAUNCHER ARGS...``: run a job, exit with the status its ranks meant.

A fault-tolerant run is launched with ``mpirun --enable-recovery``, which keeps the survivors
of a dead rank alive but then exits 0 whatever its ranks' statuses were. Every rank of such a
run leaves its status in ``$ASHL_STATUS_DIR/rank<r>.json`` as it exits (ashl.torch.exit);
this wrapper makes that directory, runs the launcher, and exits with: the status of a rank
that failed (any but 0 and 3), else ``LOST_RANKS_STATUS`` (3) if a rank wrote none (killed,
or its host gone) or the run went on without some rank, else the launcher's own. It names
each such rank. Example::

    python -m ashl.run mpirun -np 4 --enable-recovery python -m ashl.train --fault-tolerant

``--status-dir DIR`` keeps the statuses in DIR instead of a temporary directory (ranks on
other hosts need one that every host sees).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

ENV = "ASHL_STATUS_DIR"
_MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun")

__all__ = ["write_status", "read_statuses", "job_status", "main"]


def write_status(rank: int, size: int, status: int, lost: Sequence[int]) -> None:
    """This rank's exit status, for the wrapper (nothing without ASHL_STATUS_DIR)."""
    where = os.environ.get(ENV)
    if not where:
        return
    path = os.path.join(where, f"rank{rank}.json")
    try:
        with open(f"{path}.tmp", "w") as f:
            json.dump({"rank": rank, "size": size, "status": status, "lost": list(lost)}, f)
        os.replace(f"{path}.tmp", path)
    except OSError as e:   # the status is a courtesy; the exit must go on
        print(f"ashl: rank {rank}: could not write its status to {where}: {e}", file=sys.stderr)


def read_statuses(where: str) -> dict[int, dict]:
    out = {}
    for name in os.listdir(where):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(where, name)) as f:
                    record = json.load(f)
                out[int(record["rank"])] = record
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return out


def job_status(launcher_status: int, statuses: dict[int, dict]) -> tuple[int, list[str]]:
    """The job's status and what to say about it (pure)."""
    from .torch.exit import LOST_RANKS_STATUS
    if not statuses:
        return launcher_status, []
    size = max(int(r.get("size", 0)) for r in statuses.values())
    worst, notes = launcher_status, []
    silent = [r for r in range(size) if r not in statuses]
    if silent:
        worst = max(worst, LOST_RANKS_STATUS)
        notes.append(f"rank(s) {', '.join(map(str, silent))} left no exit status "
                     "(killed, or their host was lost)")
    lost = sorted({x for r in statuses.values() for x in r.get("lost", [])})
    if lost:
        notes.append(f"the run lost rank(s) {', '.join(map(str, lost))} and went on without them")
    failed = [(rank, int(r["status"])) for rank, r in sorted(statuses.items())
              if int(r.get("status") or 0) not in (0, LOST_RANKS_STATUS)]
    for rank, status in failed:
        notes.append(f"rank {rank} exited with status {status}")
    if failed:   # a failure outranks "went on without a rank"
        return max(status for _, status in failed), notes
    if any(int(r.get("status") or 0) == LOST_RANKS_STATUS for r in statuses.values()):
        worst = max(worst, LOST_RANKS_STATUS)
    return worst, notes


def _with_exported(cmd: list[str]) -> list[str]:
    """mpirun only forwards a variable to other hosts when told (-x)."""
    if cmd and os.path.basename(cmd[0]) in _MPI_LAUNCHERS:
        return [cmd[0], "-x", ENV] + cmd[1:]
    return cmd


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="ashl.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--status-dir", default=None,
                   help="where the ranks leave their statuses (default: a temporary directory)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the launcher and its arguments")
    args = p.parse_args(argv)
    if not args.command:
        p.error("no command: give the launcher and its arguments, e.g. mpirun -np 4 ...")
    where = args.status_dir or tempfile.mkdtemp(prefix="ashl-status-")
    os.makedirs(where, exist_ok=True)
    try:
        env = dict(os.environ, **{ENV: os.path.abspath(where)})
        try:
            launcher = subprocess.run(_with_exported(args.command), env=env).returncode
        except FileNotFoundError:
            p.error(f"no such launcher: {args.command[0]}")
        status, notes = job_status(launcher, read_statuses(where))
    finally:
        if args.status_dir is None:
            shutil.rmtree(where, ignore_errors=True)
    for note in notes:
        print(f"ashl.run: {note}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
