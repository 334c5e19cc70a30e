"""``python -m ashl.bench script``: a user's Horovod script against its three-line ashl
conversion, on the same emulated cluster.

Each repeat launches ``mpirun -np R`` twice, side by side in time: the unchanged Horovod script
(through ``python -m ashl.emulate``, which applies the compute slowdowns to any script) and
``ashl.convert``'s conversion of it (ashl reads the same ``ASHL_EMULATE_COMPUTE`` and
``ASHL_EMULATE_STEP_TIME``: with ``--step-time S`` a rank's step lasts its factor x S, the
real forward/backward inside it, as on a GPU whose host CPU is idle). The
script's own per-epoch lines ``Test set: Average loss: L, Accuracy: A%`` (rank 0, averaged over
the ranks with ``hvd.allreduce``) are timestamped as they arrive. Reported, as medians over
the repeats with min-max: final accuracy, wall time (launch to exit, start-up included),
and the time to reach the target accuracy, which is Horovod's median final accuracy less
``--band`` (the accuracy a user gets from the Horovod script), from the launch and from the
end of the first epoch (start-up, imports and data loading take seconds on a small job and
are the same for both); and per repeat the ratio of ashl's times to Horovod's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

from ..cli import OptionError, parse_factors
from ..convert import convert
from .e2e import SRC, _mpi_env

_TEST_LINE = re.compile(r"Test set: Average loss: ([-\d.eE+]+), Accuracy: ([\d.]+)%")
DEFAULT_SCRIPT = os.path.join(os.path.dirname(SRC), "examples", "horovod_digits.py")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--script", default=DEFAULT_SCRIPT, help="a Horovod PyTorch script")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--compute-slowdown", default="1,2,4", metavar="F0,F1,...",
                   help="per-rank compute slowdowns (ASHL_EMULATE_COMPUTE); 1 = homogeneous")
    p.add_argument("--step-time", type=float, default=0.02, metavar="S",
                   help="a factor-1 rank's emulated step in seconds (ASHL_EMULATE_STEP_TIME); "
                        "0: the real compute, stretched by the factors")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--band", type=float, default=0.02,
                   help="the target is Horovod's median final accuracy less this")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--json", default=os.path.join("out", "script", "script.json"))
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="after --: arguments for the script (e.g. -- --epochs 20)")


def launch(script: str, ranks: int, factors: Sequence[float], args: Sequence[str],
           via_emulate: bool, timeout: float, step_s: float = 0.0) -> dict:
    """One mpirun of `script`; its test accuracy per epoch, timestamped, and its wall time."""
    env = _mpi_env()
    env["ASHL_EMULATE_COMPUTE"] = ",".join(f"{f:g}" for f in factors)
    env["ASHL_EMULATE_STEP_TIME"] = f"{step_s:g}" if step_s > 0 else ""
    runner = ["-m", "ashl.emulate"] if via_emulate else []
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none",
           "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "ASHL_EMULATE_COMPUTE",
           "-x", "ASHL_EMULATE_STEP_TIME",
           sys.executable, *runner, script, *args]
    t0 = time.monotonic()
    curve, tail = [], []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, start_new_session=True) as proc:
        for line in proc.stdout:
            tail = (tail + [line])[-20:]
            m = _TEST_LINE.search(line)
            if m:
                curve.append((time.monotonic() - t0, float(m.group(2)) / 100))
            if time.monotonic() - t0 > timeout:
                proc.kill()
        rc = proc.wait()
    return {"rc": rc, "wall_s": time.monotonic() - t0, "curve": curve,
            "final_accuracy": curve[-1][1] if curve else None,
            "log_tail": "".join(tail) if rc else ""}


def time_to(curve: Sequence[tuple], target: float) -> Optional[float]:
    return next((t for t, acc in curve if acc >= target), None)


def spread(values: Sequence[Optional[float]]) -> dict:
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def summarize(runs: dict, band: float) -> dict:
    """Medians and spreads per side, the target, and ashl's time over Horovod's per repeat."""
    target = spread([r["final_accuracy"] for r in runs["horovod"]])["median"]
    target = None if target is None else target - band
    out = {"target_accuracy": target}
    keys = ("final_accuracy", "wall_s", "time_to_target_s", "training_to_target_s")
    for side, rs in runs.items():
        for r in rs:
            t = None if target is None else time_to(r["curve"], target)
            r["time_to_target_s"] = t
            r["training_to_target_s"] = None if t is None else t - r["curve"][0][0]
        out[side] = {k: spread([r[k] for r in rs]) for k in keys}
    for key in ("time_to_target_s", "training_to_target_s"):
        out["ratio_" + key] = spread([a[key] / h[key] for a, h in zip(runs["ashl"], runs["horovod"])
                                      if a[key] is not None and h[key]])
    return out


def table(summary: dict) -> str:
    def fmt(s, scale=1.0, unit=""):
        if s["median"] is None:
            return "missed"
        return f"{s['median'] * scale:.2f}{unit} [{s['min'] * scale:.2f}-{s['max'] * scale:.2f}]"
    lines = ["| script | final accuracy | wall [s] | time to target [s] | after the first epoch [s] |",
             "|---|---|---|---|---|"]
    for side in ("horovod", "ashl"):
        s = summary[side]
        lines.append(f"| {side} | {fmt(s['final_accuracy'], 100, '%')} | {fmt(s['wall_s'])} | "
                     f"{fmt(s['time_to_target_s'])} | {fmt(s['training_to_target_s'])} |")
    target = summary["target_accuracy"]
    lines.append("")
    if target is None:
        lines.append("Horovod reached no accuracy")
        return "\n".join(lines)
    lines.append(f"target {100 * target:.2f}% (Horovod's median final accuracy - band); ashl's "
                 f"time to it / Horovod's: {fmt(summary['ratio_time_to_target_s'])}x from the "
                 f"launch, {fmt(summary['ratio_training_to_target_s'])}x after the first epoch")
    return "\n".join(lines)


def run(args) -> int:
    try:
        factors = parse_factors("--compute-slowdown", args.compute_slowdown)
    except OptionError as e:
        print(f"ashl.bench script: error: {e}", file=sys.stderr)
        return 2
    if args.ranks < 1 or args.repeats < 1:
        print("ashl.bench script: error: --ranks and --repeats must be >= 1", file=sys.stderr)
        return 2
    if not args.step_time >= 0:
        print("ashl.bench script: error: --step-time must be >= 0 s", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.json))
    os.makedirs(out_dir, exist_ok=True)
    converted = os.path.join(out_dir, "ashl_" + os.path.basename(args.script))
    with open(args.script) as f, open(converted, "w") as g:
        g.write(convert(f.read()))
    extra = [a for a in args.script_args if a != "--"]
    runs = {"horovod": [], "ashl": []}
    for i in range(args.repeats):
        for side, script in (("horovod", args.script), ("ashl", converted)):
            r = launch(script, args.ranks, factors, extra, side == "horovod", args.timeout,
                       args.step_time)
            runs[side].append(r)
            print(f"  repeat {i + 1} {side:8s} rc {r['rc']}, final accuracy "
                  f"{r['final_accuracy']}, wall {r['wall_s']:.1f} s", flush=True)
            if r["rc"]:
                print(r["log_tail"], file=sys.stderr)
    summary = summarize(runs, args.band)
    with open(args.json, "w") as f:
        json.dump({"scenario": {"script": args.script, "ranks": args.ranks,
                                "compute_slowdown": factors, "step_time_s": args.step_time,
                                "repeats": args.repeats,
                                "band": args.band, "script_args": extra},
                   "summary": summary, "runs": runs}, f, indent=1)
    print(table(summary))
    print(f"results: {args.json}")
    return 1 if any(r["rc"] for rs in runs.values() for r in rs) else 0
