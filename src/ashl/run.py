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
other hosts need one that every host sees). When every rank has left or was declared lost
and the launcher still runs ``--grace`` seconds later (mpirun waits for ever for the daemon
of a host cut off mid-run), the launcher is ended.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

ENV = "ASHL_STATUS_DIR"
_MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun")
# Here, not in ashl.torch.exit (which re-exports it): importing ashl.torch starts MPI, and
# this wrapper runs outside the job.
LOST_RANKS_STATUS = 3         # a fault-tolerant run ended, but without some of its ranks

__all__ = ["LOST_RANKS_STATUS", "write_status", "read_statuses", "job_status", "settled", "main"]


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


def clear_statuses(where: str) -> None:
    for name in os.listdir(where):
        if name.startswith("rank") and name.endswith(".json"):
            os.remove(os.path.join(where, name))


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
    # A rank the run declared lost may still exit (cut off, it then loses the server): its
    # failure is the loss the survivors already report, not the run's.
    failed = [(rank, int(r["status"])) for rank, r in sorted(statuses.items())
              if int(r.get("status") or 0) not in (0, LOST_RANKS_STATUS) and rank not in lost]
    for rank, status in failed:
        notes.append(f"rank {rank} exited with status {status}")
    if failed:   # a failure outranks "went on without a rank"
        return max(status for _, status in failed), notes
    if any(int(r.get("status") or 0) == LOST_RANKS_STATUS for r in statuses.values()):
        worst = max(worst, LOST_RANKS_STATUS)
    return worst, notes


def settled(statuses: dict[int, dict]) -> bool:
    """Every rank of the job has left a status or was declared lost by one that did (pure):
    the run is over, whatever the launcher still waits for."""
    if not statuses:
        return False
    size = max(int(r.get("size", 0)) for r in statuses.values())
    lost = {x for r in statuses.values() for x in r.get("lost", [])}
    return all(rank in statuses or rank in lost for rank in range(size))


def _wait(proc: subprocess.Popen, where: str, grace_s: float) -> tuple[int, Optional[str]]:
    """The launcher's status; if the run is over (settled) and the launcher still runs after
    `grace_s` (mpirun waits for ever on a host cut off mid-run: its daemon never reports), the
    launcher is ended and reported 0, with a note saying so."""
    over_since = None
    while True:
        try:
            return proc.wait(timeout=0.5), None
        except subprocess.TimeoutExpired:
            pass
        if over_since is None and settled(read_statuses(where)):
            over_since = time.monotonic()
        if over_since is not None and time.monotonic() - over_since > grace_s:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            return 0, (f"every rank had left or was lost, but the launcher still ran {grace_s:g} s "
                       "later (a lost host's daemon never reports): it was ended")


def _with_exported(cmd: list[str]) -> list[str]:
    """mpirun only forwards a variable to other hosts when told (-x)."""
    if cmd and os.path.basename(cmd[0]) in _MPI_LAUNCHERS:
        return [cmd[0], "-x", ENV] + cmd[1:]
    return cmd


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="ashl.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--status-dir", default=None,
                   help="where the ranks leave their statuses (default: a temporary directory)")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="end the launcher this long after every rank has left or was lost")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the launcher and its arguments")
    args = p.parse_args(argv)
    if not args.command:
        p.error("no command: give the launcher and its arguments, e.g. mpirun -np 4 ...")
    where = args.status_dir or tempfile.mkdtemp(prefix="ashl-status-")
    os.makedirs(where, exist_ok=True)
    clear_statuses(where)     # an earlier job's statuses in the same folder are not this one's
    try:
        env = dict(os.environ, **{ENV: os.path.abspath(where)})
        try:
            proc = subprocess.Popen(_with_exported(args.command), env=env)
        except FileNotFoundError:
            p.error(f"no such launcher: {args.command[0]}")
        launcher, ended = _wait(proc, where, args.grace)
        status, notes = job_status(launcher, read_statuses(where))
        notes += [ended] if ended else []
    finally:
        if args.status_dir is None:
            shutil.rmtree(where, ignore_errors=True)
    for note in notes:
        print(f"ashl.run: {note}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
