"""``python -m ashl.bench transport``: the commit round trip against message size, over both
commit transports (``ashl.transport``: MPI point-to-point, the default, and ZeroMQ, the
fault-tolerant one) in one run.

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
from .transport_worker import DEFAULT_POLL_S, TRANSPORTS

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
    if not args.timeout > 0:
        raise OptionError(f"--timeout {args.timeout:g}: must be > 0")
    return sizes


def worker_command(args, sizes: list[int], out: str) -> list[str]:
    return [args.mpirun, "-np", "2", "--oversubscribe", "--bind-to", "none",
            "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED",
            sys.executable, "-m", "ashl.bench.transport_worker",
            "--sizes", ",".join(map(str, sizes)), "--repeat", str(args.repeat),
            "--warmup", str(args.warmup), "--poll-s", repr(args.poll_s), "--out", out]


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
    """One size: both transports, and zmq/mpi round by round."""
    n, times = raw["bytes"], raw["times_s"]
    row = {"bytes": n, "size": format_size(n), "zmq_endpoint": raw["zmq_endpoint"]}
    row.update({t: transport_row(times[t], n, raw["corrupt"][t]) for t in TRANSPORTS})
    row["zmq_over_mpi"] = spread([z / m for z, m in zip(times["zmq"], times["mpi"])])
    return row


def summarize(raw: dict, args) -> dict:
    """The report: how it was measured (so a JSON file explains itself), then a row a size."""
    rows = [size_row(r) for r in raw["sizes"]]
    corrupt = sum(r[t]["corrupt"] for r in rows for t in TRANSPORTS)
    return {"benchmark": "transport", **raw["environment"], "ranks": 2,
            "repeat": args.repeat, "warmup": args.warmup, "mpi_poll_s": raw["mpi_poll_s"],
            "transports": list(TRANSPORTS),
            "server": "a thread on rank 0 (as ashl's ServerThread), rank 1 commits",
            "order": "per size, one round trip per transport a round, mpi first in even rounds",
            "bytes_per_mb": 1e6, "corrupt_round_trips": corrupt, "results": rows}


def _cells(row: dict) -> list[str]:
    out = [row["size"]]
    for t in TRANSPORTS:
        r = row[t]
        out += [f"{r['median_ms']:.3f} [{r['min_ms']:.3f}-{r['max_ms']:.3f}]",
                f"{r['mb_per_s']:.1f}"]
    q = row["zmq_over_mpi"]
    out.append(f"{q['median']:.2f} [{q['min']:.2f}-{q['max']:.2f}]")
    bad = [t for t in TRANSPORTS if row[t]["corrupt"]]
    return out + [("CORRUPT: " + ",".join(bad)) if bad else ""]


def format_table(result: dict) -> str:
    head = ["size"] + [h for t in TRANSPORTS for h in (f"{t} ms", f"{t} MB/s")] + ["zmq/mpi", ""]
    body = [_cells(r) for r in result["results"]]
    widths = [max(len(c) for c in col) for col in zip(head, *body)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    title = (f"commit round trip on {result['host']} ({result['cpus']} cpus), 2 ranks, "
             f"{result['mpi_library'].split(',')[0]}, ZeroMQ {result['zmq_version']}: median "
             f"[min-max] of {result['repeat']} after {result['warmup']} warm-up, MPI polled "
             f"every {result['mpi_poll_s']:g} s; MB/s = 2 x size / median")
    rule = "-" * len(line(head))
    return "\n".join([title, line(head), rule] + [line(c) for c in body])


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
