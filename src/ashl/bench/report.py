"""What a benchmark run's outputs say beyond its time to target: throughput against the limit,
emulation overruns, and the figures (accuracy against time, per-rank utilisation, one round's
timeline per strategy).

The limit: with GPU-like steps of S seconds, a rank of compute factor f takes a step every
f x S seconds when it never waits, so the cluster's ideal throughput is
sum over ranks of batch / (f x S) samples per second. A strategy's throughput is the samples
its ranks trained on over its wall time; its fraction of the ideal says how much of the
cluster it used, whatever its accuracy per sample.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

__all__ = ["throughput", "plot_accuracy", "plot_utilization", "plot_round_timelines",
           "round_window"]


def throughput(summary: dict) -> dict:
    """From a run's summary.json: samples/s, the ideal samples/s (None without emulated step
    times), their ratio, and the emulated steps whose real work overran the step time."""
    batch, wall = summary.get("batch_size"), summary.get("wall_s")
    per_rank = summary.get("per_rank") or []
    steps = [(r.get("counters") or {}).get("local_steps") or 0 for r in per_rank]
    emulation = [(r.get("counters") or {}).get("emulation") or {} for r in per_rank]
    out = {"samples_per_s": None, "ideal_samples_per_s": None, "throughput_fraction": None,
           "emulated_steps": sum(e.get("steps") or 0 for e in emulation),
           "overruns": sum(e.get("overruns") or 0 for e in emulation)}
    if not (batch and wall and per_rank):
        return out
    out["samples_per_s"] = sum(steps) * batch / wall
    rates = [1.0 / (e["factor"] * e["step_s"]) for e in emulation
             if e.get("step_s") and e.get("factor")]
    if len(rates) == len(per_rank):    # every rank's speed is known: the limit is too
        out["ideal_samples_per_s"] = batch * sum(rates)
        out["throughput_fraction"] = out["samples_per_s"] / out["ideal_samples_per_s"]
    return out


# ---------------------------------------------------------------------------- figures

def pyplot():
    """matplotlib.pyplot on the file-only back end."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_accuracy(curves: Sequence[tuple[str, list[dict]]], path: str, target: float,
                  title: str) -> None:
    """Test accuracy against wall time, one line per (label, metrics rows)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, rows in curves:
        rows = [x for x in rows if x.get("accuracy") is not None]
        if rows:
            ax.plot([x["t"] for x in rows], [x["accuracy"] for x in rows], marker=".",
                    markersize=3, linewidth=1.4, label=label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("wall time [s], profiling included")
    ax.set_ylabel("test accuracy (rank 0)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", title=f"time to {target:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_utilization(bars: Sequence[tuple[str, Sequence[float]]], path: str, title: str) -> None:
    """Per-rank utilisation (compute time over wall time), one group of bars per strategy."""
    plt = pyplot()
    bars = [(name, list(u)) for name, u in bars if u]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(bars) + 2), 4))
    ranks = max((len(u) for _, u in bars), default=0)
    width = 0.8 / max(ranks, 1)
    for r in range(ranks):
        xs = [i + (r - (ranks - 1) / 2) * width for i, (_, u) in enumerate(bars) if r < len(u)]
        ys = [u[r] for _, u in bars if r < len(u)]
        ax.bar(xs, ys, width=width, label=f"rank {r}")
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], rotation=20)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("utilisation (compute / wall)")
    ax.set_title(title)
    ax.legend(fontsize="small", ncol=min(ranks, 8))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _spans(timeline_path: str) -> list[dict]:
    with open(timeline_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and e.get("name") in ("compute", "commit")]


def round_window(spans: Sequence[dict], at: float = 0.6) -> Optional[tuple[float, float]]:
    """(start, end) in µs of one round in the run's steady state: the window that starts at
    fraction `at` of the traced time and lasts the slowest rank's longest compute + commit
    pair there, so every rank's round shows at least once."""
    if not spans:
        return None
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    start = t0 + at * (t1 - t0)
    rounds = {}
    for e in spans:
        if e["ts"] + e["dur"] >= start:
            rounds.setdefault(e["pid"], []).append(e)
    # a rank's round: its next compute span and the commit after it
    length = max((sum(x["dur"] for x in sorted(s, key=lambda x: x["ts"])[:2])
                  for s in rounds.values()), default=0.0)
    return (start, start + max(length, 1.0))


def plot_round_timelines(runs: Sequence[tuple[str, str]], path: str, title: str) -> None:
    """One panel per (label, timeline.json): every rank's compute (blue) and commit (orange)
    spans over one round of the steady state; white is waiting."""
    plt = pyplot()
    runs = [(label, p) for label, p in runs if p and os.path.exists(p)]
    if not runs:
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.1 + 0.9 * len(runs)), squeeze=False)
    colours = {"compute": "tab:blue", "commit": "tab:orange"}
    for ax, (label, p) in zip(axes[:, 0], runs):
        spans = _spans(p)
        window = round_window(spans)
        ax.set_title(label, fontsize="small", loc="left")
        if window is None:
            continue
        lo, hi = window
        ranks = sorted({e["pid"] for e in spans})
        for e in spans:
            a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
            if b > a:
                ax.barh(e["pid"], (b - a) / 1e3, left=(a - lo) / 1e3, height=0.7,
                        color=colours[e["name"]])
        ax.set_yticks(ranks, [f"r{r}" for r in ranks], fontsize="x-small")
        ax.set_xlim(0, (hi - lo) / 1e3)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("ms into the round (blue: compute, orange: commit, white: waiting)")
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
