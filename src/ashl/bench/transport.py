"""``python -m ashl.bench transport``: the commit round trip against message size, over both
commit transports (``ashl.transport``: ZeroMQ, the default, and MPI point-to-point) in one
run, for a rank's commits (zmq over TCP, mpi) and for the server rank's own (inproc,
mpi-self); then what waiting costs each transport in CPU.

A round trip is what a commit costs a rank: a DENSE_DELTA of N bytes to the server, and the
server's REPLY carrying N bytes back (as the model a real reply carries). This launches
``mpirun -np 2`` on this host and runs :mod:`ashl.bench.transport_worker` under it: rank 0
serves from a thread (as ashl's server does), rank 1 commits; per size the transports are
interleaved round by round, and every reply's bytes are checked against the commit's (the
module's docstring has the details). Every size gets ``--repeat`` timed round trips per
transport, the big ones too (64 MiB: about 0.2 s a round on a 2-core machine; the default run
takes about half a minute), after ``--warmup`` untimed ones.

Reported per size and transport: the median round trip with its min-max, in ms; MB/s, the
2 x N payload bytes (1 MB = 10^6 bytes) over the median; and zmq/mpi, the ratio of the two
transports' round trips paired round by round (median, min-max). On one host MPI goes
through shared memory and ZeroMQ through loopback TCP; between hosts both are TCP, so these
figures are the transports' own costs, not a network's. The MPI ends poll (they sleep
``--poll-s`` between probes, as in a real run) where ZeroMQ's block until a message comes:
at small sizes MPI's round trip is mostly those sleeps.

The idle cost (``--hold-s``, ``--hold-repeat``; 0 skips it): the server thread holds each
of rank 1's commits ``--hold-s`` before it answers, waiting meanwhile as it waits between
commits. Reported per transport, as median [min-max] over the repeats: the server thread's
CPU share (its CPU time over the window) and wake-ups per second, and the waiting rank's
CPU share (its whole process) and its waiting thread's wake-ups per second.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

from ..cli import OptionError, error_line
from .e2e import _tail, launch
from .script import spread
from .transport_worker import DEFAULT_POLL_S, SELF_TRANSPORTS, TRANSPORTS

ALL = TRANSPORTS + SELF_TRANSPORTS
RATIOS = {"zmq_over_mpi": ("zmq", "mpi"), "inproc_over_mpi_self": ("inproc", "mpi-self")}

PROG = "ashl.bench transport"
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE = re.compile(r"(\d+)([KMG]?)(?:I?B)?", re.IGNORECASE)
MAX_SIZE = 1 << 30   # well inside one message's limit (protocol.MAX_MESSAGE_BYTES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=DEFAULT_SIZES, metavar="S0,S1,...",
                   help=f"payload sizes in bytes, K/M/G being powers of 1024, each a multiple "
                        f"of 4 (float32 elements) (default {DEFAULT_SIZES})")
    p.add_argument("--repeat", type=int, default=30,
                   help="timed round trips per size and transport (default 30)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed round trips per size and transport first (default 3)")
    p.add_argument("--poll-s", type=float, default=DEFAULT_POLL_S, metavar="S",
                   help="how long the MPI ends sleep between looks for a message (default "
                        f"{DEFAULT_POLL_S:g}, ashl.transport's); it bounds MPI's small-message "
                        "round trip from below")
    p.add_argument("--hold-s", type=float, default=1.0, metavar="S",
                   help="the idle cost: how long the server holds each commit (default 1; "
                        "0 skips it)")
    p.add_argument("--hold-repeat", type=int, default=5,
                   help="held commits per transport (default 5)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="kill the run after this many seconds (default 900)")
    p.add_argument("--mpirun", default="mpirun", help="the launcher command")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")


def parse_sizes(text: str) -> list[int]:
    """'1K,64K,1M' -> [1024, 65536, 1048576]: distinct, multiples of 4, at most 1 GiB."""
    sizes = []
    for item in (s.strip() for s in text.split(",")):
        m = _SIZE.fullmatch(item)
        if not m:
            raise OptionError(f"--sizes {text!r}: {item!r} is not a size (e.g. 4096, 64K, 1M)")
        n = int(m.group(1)) * _UNITS[m.group(2).upper()]
        if n <= 0 or n % 4 or n > MAX_SIZE:
            raise OptionError(f"--sizes {text!r}: {item!r} must be a multiple of 4 bytes, "
                              f"from 4 to 1G")
        sizes.append(n)
    if len(set(sizes)) != len(sizes):
        raise OptionError(f"--sizes {text!r}: a size given twice")
    return sizes


def format_size(n: int) -> str:
    """1024 -> '1K', 65536 -> '64K', 1000 -> '1000'."""
    for unit in ("G", "M", "K"):
        if n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def check(args) -> list[int]:
    sizes = parse_sizes(args.sizes)
    if args.repeat < 1:
        raise OptionError(f"--repeat {args.repeat}: must be >= 1")
    if args.warmup < 0:
        raise OptionError(f"--warmup {args.warmup}: must be >= 0")
    if not args.poll_s >= 0:
        raise OptionError(f"--poll-s {args.poll_s:g}: must be >= 0")
    if not args.hold_s >= 0:
        raise OptionError(f"--hold-s {args.hold_s:g}: must be >= 0")
    if args.hold_repeat < 0:
        raise OptionError(f"--hold-repeat {args.hold_repeat}: must be >= 0")
    if not args.timeout > 0:
        raise OptionError(f"--timeout {args.timeout:g}: must be > 0")
    return sizes


def worker_command(args, sizes: list[int], out: str) -> list[str]:
    return [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none",
            "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED",
            sys.executable, "-m", "ashl.bench.transport_worker",
            "--sizes", ",".join(map(str, sizes)), "--repeat", str(args.repeat),
            "--warmup", str(args.warmup), "--poll-s", repr(args.poll_s),
            "--hold-s", repr(args.hold_s), "--hold-repeat", str(args.hold_repeat), "--out", out]


def run_worker(args, sizes: list[int]) -> dict:
    """The worker's results; RuntimeError (with its output's last lines) if it failed."""
    with tempfile.TemporaryDirectory(prefix="ashl-bench-transport-") as tmp:
        raw, log = os.path.join(tmp, "raw.json"), os.path.join(tmp, "log.txt")
        status, error = launch(worker_command(args, sizes, raw), log, args.timeout, (tmp, tmp))
        if status == "ok" and not os.path.exists(raw):
            status, error = "failed", "the worker wrote no results"
        if status != "ok":
            raise RuntimeError(f"{status}: {error}; its last lines:\n{_tail(log, 20)}")
        with open(raw) as f:
            return json.load(f)


def transport_row(times_s: list[float], nbytes: int, corrupt: int) -> dict:
    """One transport at one size: the round trip's median and min-max, its throughput."""
    s = spread(times_s)
    return {"median_ms": s["median"] * 1e3, "min_ms": s["min"] * 1e3, "max_ms": s["max"] * 1e3,
            "mb_per_s": 2 * nbytes / s["median"] / 1e6, "n": s["n"], "corrupt": corrupt,
            "times_s": times_s}


def size_row(raw: dict) -> dict:
    """One size: every transport, and zmq/mpi and inproc/mpi-self round by round."""
    n, times = raw["bytes"], raw["times_s"]
    row = {"bytes": n, "size": format_size(n), "zmq_endpoint": raw["zmq_endpoint"]}
    row.update({t: transport_row(times[t], n, raw["corrupt"][t]) for t in ALL})
    for key, (a, b) in RATIOS.items():
        row[key] = spread([x / y for x, y in zip(times[a], times[b])])
    return row


def shares(rounds: list[dict]) -> dict:
    """Held rounds -> the CPU share (CPU s / wall s) and wake-ups per second, each as
    median, min, max, n."""
    return {"cpu_share": spread([r["cpu_s"] / r["wall_s"] for r in rounds]),
            "wakeups_per_s": spread([r["wakeups"] / r["wall_s"] for r in rounds])}


def idle_rows(idle: "dict | None") -> "dict | None":
    """Per transport: the server thread's and the waiting rank's shares() over the holds."""
    if not idle:
        return None
    return {t: {side: shares(idle[t][side]) for side in ("server", "waiting")} for t in idle}


def summarize(raw: dict, args) -> dict:
    """The report: how it was measured (so a JSON file explains itself), then a row a size."""
    rows = [size_row(r) for r in raw["sizes"]]
    corrupt = sum(r[t]["corrupt"] for r in rows for t in ALL)
    return {"benchmark": "transport", **raw["environment"], "ranks": 2,
            "repeat": args.repeat, "warmup": args.warmup, "mpi_poll_s": raw["mpi_poll_s"],
            "transports": list(ALL),
            "server": "a thread on rank 0 (as ashl's ServerThread); rank 1 commits over mpi "
                      "and zmq (tcp), rank 0's main thread over mpi-self and inproc",
            "order": "per size, one round trip per transport a round, mpi first in even rounds",
            "bytes_per_mb": 1e6, "corrupt_round_trips": corrupt, "results": rows,
            "hold_s": raw.get("hold_s"), "idle": idle_rows(raw.get("idle"))}


def _cell(s: dict, scale: float = 1.0, fmt: str = ".2f") -> str:
    return (f"{s['median'] * scale:{fmt}} [{s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}}]"
            if s["n"] else "-")


def _cells(row: dict) -> list[str]:
    out = [row["size"]]
    for t in ALL:
        r = row[t]
        out += [f"{r['median_ms']:.3f} [{r['min_ms']:.3f}-{r['max_ms']:.3f}]",
                f"{r['mb_per_s']:.1f}"]
    out += [_cell(row[key]) for key in RATIOS]
    bad = [t for t in ALL if row[t]["corrupt"]]
    return out + [("CORRUPT: " + ",".join(bad)) if bad else ""]


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(c) for c in col) for col in zip(head, *body)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(head), "-" * len(line(head))] + [line(c) for c in body]


def format_idle(result: dict) -> list[str]:
    idle = result.get("idle")
    if not idle:
        return []
    head = ["transport", "server thread CPU %", "server wake-ups/s", "waiting rank CPU %",
            "waiting wake-ups/s"]
    body = [[t, _cell(v["server"]["cpu_share"], 100), _cell(v["server"]["wakeups_per_s"], 1, ".0f"),
             _cell(v["waiting"]["cpu_share"], 100), _cell(v["waiting"]["wakeups_per_s"], 1, ".0f")]
            for t, v in idle.items()]
    n = next(iter(idle.values()))["server"]["cpu_share"]["n"]
    title = (f"idle cost: the server holds each commit {result['hold_s']:g} s; median "
             f"[min-max] of {n}")
    return ["", title] + _table(head, body)


def format_table(result: dict) -> str:
    head = (["size"] + [h for t in ALL for h in (f"{t} ms", f"{t} MB/s")]
            + ["zmq/mpi", "inproc/mpi-self", ""])
    title = (f"commit round trip on {result['host']} ({result['cpus']} cpus), 2 ranks, "
             f"{result['mpi_library'].split(',')[0]}, ZeroMQ {result['zmq_version']}: median "
             f"[min-max] of {result['repeat']} after {result['warmup']} warm-up, MPI polled "
             f"every {result['mpi_poll_s']:g} s; MB/s = 2 x size / median; mpi-self and "
             "inproc: the server rank's own commits")
    body = [_cells(r) for r in result["results"]]
    return "\n".join([title] + _table(head, body) + format_idle(result))


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


def run(args) -> int:
    try:
        sizes = check(args)
    except OptionError as e:
        print(error_line(PROG, str(e)), file=sys.stderr)
        return 2
    print(f"{PROG}: {len(sizes)} sizes, {args.repeat} round trips each per transport",
          flush=True)
    try:
        result = summarize(run_worker(args, sizes), args)
    except RuntimeError as e:
        print(f"{PROG}: the run failed: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if result["corrupt_round_trips"]:
        print(f"{PROG}: {result['corrupt_round_trips']} replies did not carry the commit's "
              "bytes", file=sys.stderr)
        return 1
    return 0
