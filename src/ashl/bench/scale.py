"""``python -m ashl.bench scale``: the e2e scenario at 4, 8 and 16 ranks, and what it costs.

Each rank count runs every strategy as ``ashl.bench e2e`` would (the same options; compute and
link factors cycle 1,1,2,4), for the whole time budget (no stop at the target: a throughput
needs the same span for every count). Per strategy and rank count it reports the throughput as
a fraction of the ideal, the utilisation, and for the parameter-server strategies the server's
side: its commit latency (a commit received to its reply sent) and its thread's busy fraction
(CPU time over wall time), so where the server saturates shows as the count grows.

The step time is the e2e scenario's (``scenario.STEP_TIME_S``): 16 ranks' real work (8-10 ms a
step each here) must fit in the cores of the machine, or the emulation overruns (reported per
run).

Writes (next to ``--json``, default ``out/scale/scale.json``): scale.json, scale.md, scale.png
(three panels against ranks) and every run's own folder under ranks<N>/.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Optional, Sequence

from ..cli import OptionError
from . import e2e, scenario

PROG = "ashl.bench scale"
DEFAULT_RANKS = "4,8,16"
DEFAULT_STRATEGIES = "ashl,asp,bsp"
MAX_SECONDS = 40.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    e2e.add_arguments(p, ranks=False, strategies=DEFAULT_STRATEGIES)
    p.add_argument("--ranks", default=DEFAULT_RANKS, metavar="N0,N1,...",
                   help="the rank counts, each run with every strategy")
    p.set_defaults(step_time=scenario.STEP_TIME_S,
                   max_seconds=MAX_SECONDS, full_budget=True,
                   json=os.path.join("out", "scale", "scale.json"))


def parse_counts(text: str) -> list[int]:
    """'4,8,16' -> [4, 8, 16]: distinct integers >= 1, in the order given."""
    return e2e.parse_distinct_ints("--ranks", text, 1)


def server_stats(summary: dict) -> dict:
    """The server's own counters in a run's summary (the server rank's `counters.server`),
    or {} for a strategy without a server."""
    for r in summary.get("per_rank") or []:
        server = (r.get("counters") or {}).get("server")
        if server:
            return server
    return {}


def server_side(run_dir: str) -> dict:
    """The server's figures from a run's summary.json (None where the strategy has none)."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            server = server_stats(json.load(f))
    except (OSError, ValueError):
        server = {}
    latency = server.get("commit_latency") or {}
    return {"server_busy_fraction": server.get("busy_fraction"),
            "commit_latency_ms_median": latency.get("median_ms"),
            "commit_latency_ms_p95": latency.get("p95_ms")}


def row(n: int, r: dict) -> dict:
    """One strategy at one rank count, as the report keeps it."""
    util = r.get("utilization") or []
    out = {"ranks": n, "strategy": r["strategy"], "status": r["status"],
           "throughput_fraction": r.get("throughput_fraction"),
           "samples_per_s": r.get("samples_per_s"),
           "ideal_samples_per_s": r.get("ideal_samples_per_s"),
           "utilization_mean": sum(util) / len(util) if util else None,
           "utilization_min": min(util) if util else None,
           "final_accuracy": r.get("final_accuracy"),
           "overruns": r.get("overruns"), "emulated_steps": r.get("emulated_steps"),
           "run_dir": r.get("run_dir")}
    out.update(server_side(r["run_dir"]) if r.get("run_dir") else server_side(""))
    return out


def _cell(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: Sequence[dict]) -> str:
    head = ["strategy", "ranks", "of ideal", "samples/s", "util mean", "util min",
            "commit latency p50 / p95 [ms]", "server busy", "overruns", "final acc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for x in rows:
        if x["status"] != "ok":
            lines.append(f"| {x['strategy']} | {x['ranks']} | {x['status'].upper()} |" +
                         " |" * (len(head) - 3))
            continue
        steps = x.get("emulated_steps") or 0
        latency = ("-" if x["commit_latency_ms_median"] is None else
                   f"{x['commit_latency_ms_median']:.1f} / {x['commit_latency_ms_p95']:.1f}")
        lines.append("| " + " | ".join([
            x["strategy"], str(x["ranks"]), _cell(x["throughput_fraction"], ".0%"),
            _cell(x["samples_per_s"], ".0f"), _cell(x["utilization_mean"], ".0%"),
            _cell(x["utilization_min"], ".0%"), latency,
            _cell(x["server_busy_fraction"], ".0%"),
            "-" if not steps else f"{(x.get('overruns') or 0) / steps:.1%}",
            _cell(x["final_accuracy"], ".4f")]) + " |")
    return "\n".join(lines)


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    """Throughput fraction, commit latency (median) and server busy fraction against ranks."""
    from .report import pyplot
    plt = pyplot()
    panels = (("throughput_fraction", "throughput / ideal"),
              ("commit_latency_ms_median", "commit latency at the server, median [ms]"),
              ("server_busy_fraction", "server thread busy (CPU / wall)"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (key, label) in zip(axes, panels):
        for name in dict.fromkeys(x["strategy"] for x in rows):
            pts = [(x["ranks"], x[key]) for x in rows
                   if x["strategy"] == name and x.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set_xlabel("ranks")
        ax.set_title(label, fontsize="small")
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args) -> int:
    try:
        counts = parse_counts(args.ranks)
        setups = []
        for n in counts:
            a = copy.copy(args)
            a.ranks = n
            setups.append((n, a, e2e.check(a)))
    except OptionError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    json_path = os.path.abspath(args.json)
    out = os.path.abspath(args.out) if args.out else os.path.dirname(json_path)
    os.makedirs(out, exist_ok=True)
    os.makedirs(os.path.dirname(json_path), exist_ok=True)   # before the runs, not after
    rows, scenarios = [], []
    for n, a, setup in setups:
        e2e.announce(a, setup)
        scenarios.append(e2e.scenario(a, setup))
        for r in e2e.run_all(a, setup, os.path.join(out, f"ranks{n}")):
            rows.append(row(n, r))
    with open(json_path, "w") as f:
        json.dump({"scenarios": scenarios, "rows": rows}, f, indent=1)
    md = table(rows)
    stem = os.path.splitext(json_path)[0]
    title = (f"scale: {args.model}/{args.dataset}, step {args.step_time:g} s x factors 1,1,2,4 "
             f"cycled, {args.max_seconds:g} s per run")
    with open(stem + ".md", "w") as f:
        f.write(f"# ashl {title}\n\n{md}\n")
    print(f"\n{md}\n\nresults: {json_path}\ntable:   {stem}.md")
    try:
        plot(rows, stem + ".png", title)
        print(f"plot:    {stem}.png")
    except Exception as e:
        print(f"{PROG}: could not draw the plot: {e}", file=sys.stderr)
    return 1 if any(x["status"] != "ok" for x in rows) else 0
