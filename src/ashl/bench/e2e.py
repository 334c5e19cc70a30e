"""``python -m ashl.bench e2e``: every strategy on the same job, end to end.

Each strategy trains the same model on the same data from the same seed, on the same emulated
cluster (per-rank compute and link slowdowns), launched as its own
``mpirun -np R python -m ashl.train ...`` with a time budget and a timeout. A strategy that
fails or times out is reported and the others still run.

The default scenario (``ashl.bench.scenario``): real MNIST images, a CNN of 1.02M parameters,
GPU-like steps of 170 ms x the compute factor, and a factor-1 link that moves the model in
0.72 steps, as ResNet-18 on V100s over 10 Gbit/s does; target 0.97.

With ``--netns`` (root) the links are real instead of emulated: one emulated host per rank (a
network namespace ashl-h<i> on a private bridge, ``ashl.netns``), rank i's link shaped with tc
tbf in both directions to ``--netns-rate`` / its link slowdown factor, every mpirun started on
host 0 across the hosts (TCP on 10.231.7.0/24 only). Compute slowdowns stay emulated; no
emulated link delay is added. The hosts are removed at the end, whatever happens.

Writes (next to ``--json``, default ``out/e2e/e2e.json``):

    e2e.json   {"scenario": {...}, "results": [{"strategy", "status", "time_to_target_s",
               "final_accuracy", "utilization" and "busy" (per rank), "bytes_sent",
               "commits", ...}],
               "speedup_vs": {baseline: its time to target / ashl's},
               "speedup_interval_vs": {baseline: [low, high], a 90 % bootstrap interval
               of that ratio over the seeds (3 seeds or more)}, ...}
    e2e.md     the table, as printed
    e2e.png    every strategy's test accuracy against wall time
    e2e.utilization.png   every rank's utilisation, per strategy
    e2e.rounds.png        one round of the steady state per strategy: who computes, who
                          commits, who waits
    <strategy>/   each run's own output (summary.json, metrics.jsonl, curves.png, timeline.json,
                  log.txt with its stdout and stderr)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ..cli import (OptionError, add_device_option, add_run_options, add_transport_option,
                   check_device, check_factor_count, check_run_options, check_transport,
                   error_line, format_factors,
                   parse_factors, parse_link, parse_strategies, split_variant)
from ..emulation import DEFAULT_LINK
from ..launch_env import launch_env
from ..strategies import OVERLAPPING, PARAMETER_SERVER, STRATEGIES
from . import report as figures
from . import scenario as default_scenario

PROG = "ashl.bench e2e"

# The order of the comparison; only those in STRATEGIES run by default.
DEFAULT_ORDER = ("ashl", "ashl-sync", "bsp", "localsgd", "ssp", "asp", "adsp")
ASHL_FAMILY = ("ashl", "ashl-sync")
# --netns: the factor-1 link. The digits MLP's ~69 KB push takes ~5.5 ms at 100 Mbit/s and ~22 ms
# on a factor-4 link (25 Mbit/s), against 1-4 ms local steps.
DEFAULT_NETNS_RATE = "100mbit"
DEFAULT_MPIRUN_ARGS = "--oversubscribe --bind-to none"
SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_strategies() -> list[str]:
    return [s for s in DEFAULT_ORDER if s in STRATEGIES] + \
           [s for s in STRATEGIES if s not in DEFAULT_ORDER]


def add_arguments(p: argparse.ArgumentParser, ranks: bool = True,
                  strategies: Optional[str] = None) -> None:
    """e2e's options (`ranks`: with --ranks; ashl.bench scale has a list of its own, and its
    own default `strategies`)."""
    default = strategies or (f"those of {','.join(DEFAULT_ORDER)} that exist; "
                             f"now {','.join(default_strategies())}")
    p.add_argument("--strategies", default=strategies,
                   help=f"comma-separated (default: {default}); STRATEGY+SPEC runs it with that "
                        "outer optimizer, e.g. 'ashl+delayed-nesterov(0.7, 0.5)'")
    p.add_argument("--seeds", default=None, metavar="S0,S1,...",
                   help="run every strategy once per seed; the table shows medians [min-max] "
                        "(default: --seed alone)")
    if ranks:
        p.add_argument("--ranks", type=int, default=4)
    d = default_scenario
    add_run_options(p, max_seconds=d.MAX_SECONDS, target_accuracy=d.TARGET_ACCURACY,
                    model=d.MODEL, dataset=d.DATASET, step_time=d.STEP_TIME_S,
                    factors_default="default 1,1,2,4 on 4 ranks (see default_factors for "
                                    "other rank counts)",
                    link_base_note="; in this benchmark, with --step-time, the default is the "
                                   "link that moves the model in "
                                   f"{d.COMM_COMPUTE_RATIO:.2f} x the step time")
    p.add_argument("--homogeneous", action="store_true",
                   help="the control scenario: every factor 1 (the factor-1 link still emulated)")
    p.add_argument("--full-budget", action="store_true",
                   help="do not stop at the target: every run uses its whole --max-seconds")
    p.add_argument("--timeout", type=float, default=None,
                   help="kill a run after this many seconds (default: --max-seconds + 120)")
    p.add_argument("--mpirun", default="mpirun", help="the launcher command")
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS,
                   help="extra launcher arguments (one string); with --netns the hosts' own "
                        "(-H, plm_rsh_agent, btl tcp, --bind-to none) replace the default")
    p.add_argument("--hostfile", default=None,
                   help="run the ranks on these hosts (Open MPI format, checked first; "
                        "not with --netns)")
    p.add_argument("--netns", action="store_true",
                   help="real shaped links instead of emulated ones (root): one network-namespace "
                        "host per rank, rank i's link shaped to --netns-rate / its link slowdown; "
                        "--link-base does not apply")
    p.add_argument("--netns-rate", default=DEFAULT_NETNS_RATE, metavar="RATE",
                   help="with --netns: the factor-1 link's rate, tc syntax in bits "
                        "(e.g. 100mbit, 500kbit)")
    add_transport_option(p, "ashl.train's, zmq")
    add_device_option(p)
    p.add_argument("--out", default=None, help="directory of the runs (default: next to --json)")
    p.add_argument("--json", default=os.path.join("out", "e2e", "e2e.json"),
                   help="where the results go (.md table and .png plot beside it)")


def _error(message: str) -> int:
    print(error_line(PROG, message), file=sys.stderr)
    return 2


def default_factors(ranks: int) -> list[float]:
    """The default cluster: 1,1,2,4 on 4 ranks (cycled beyond); 1 / 1,4 / 1,2,4 below."""
    if ranks >= 4:
        return [(1.0, 1.0, 2.0, 4.0)[i % 4] for i in range(ranks)]
    return [[1.0], [1.0, 4.0], [1.0, 2.0, 4.0]][ranks - 1]


def rank_factors(option: str, text: Optional[str], ranks: int) -> list[float]:
    """One factor per rank: the option's list padded with 1s, default_factors without it."""
    if text is None:
        return default_factors(ranks)
    values = parse_factors(option, text)
    check_factor_count(option, text, values, ranks)
    return values + [1.0] * (ranks - len(values))


def _mpi_env() -> dict:
    env = launch_env(os.environ)   # not the launch variables of a job we may run inside
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    env.pop("ASHL_TIMELINE", None)   # each run writes its own timeline.json
    for name in ("ASHL_EMULATE_COMPUTE", "ASHL_EMULATE_LINK", "ASHL_EMULATE_LINK_BASE"):
        env.pop(name, None)          # the scenario comes from the options, nothing else
    return env


def train_command(args, strategy: str, run_dir: str, compute: Sequence[float],
                  link: Sequence[float], hosts=None, seed: Optional[int] = None) -> list[str]:
    """The launcher command of one run (`strategy` may be STRATEGY+OUTER_SPEC). With `hosts`
    (--netns): mpirun across the emulated hosts, started on host 0, and no emulated link
    (the links are real)."""
    strategy, outer = split_variant(strategy)
    seed = args.seed if seed is None else seed
    if hosts is None:
        launch = shlex.split(args.mpirun_args)
        if args.hostfile is not None:
            launch += ["--hostfile", args.hostfile]
    else:
        from .. import netns
        extra = "" if args.mpirun_args == DEFAULT_MPIRUN_ARGS else args.mpirun_args
        launch = [*netns.mpirun_args(hosts), *shlex.split(extra)]
    cmd = [args.mpirun, "-np", str(args.ranks), *launch,
           "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED",
           sys.executable, "-m", "ashl.train", "--strategy", strategy,
           *([] if outer is None else ["--outer-optimizer", outer]),
           "--model", args.model, "--dataset", args.dataset,
           "--compute-slowdown", format_factors(compute)]
    if hosts is None:
        cmd += ["--link-slowdown", format_factors(link)]
    cmd += ["--max-seconds", f"{args.max_seconds:g}", "--seed", str(seed),
            "--batch-size", str(args.batch_size), "--lr", f"{args.lr:g}",
            "--out", run_dir, "--no-progress"]
    if args.step_time is not None:
        cmd += ["--step-time", f"{args.step_time:g}"]
    cmd += ["--device", args.device]
    if args.link_base and hosts is None:
        cmd += ["--link-base", args.link_base]
    if not args.full_budget:
        cmd += ["--target-accuracy", f"{args.target_accuracy:g}"]
    if args.eval_every is not None:
        cmd += ["--eval-every", f"{args.eval_every:g}"]
    transport = getattr(args, "transport", None)
    if transport is not None and strategy in PARAMETER_SERVER:
        cmd += ["--transport", transport]
    if args.overlap is not None and strategy in OVERLAPPING:   # None: each one's default
        cmd += ["--overlap" if args.overlap else "--no-overlap"]
    if hosts is not None:
        cmd = hosts.command(0, cmd)
    return cmd


def _kill_group(proc: subprocess.Popen) -> None:
    """End the launcher we started and its ranks (its own process group), politely first."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_strategy(args, strategy: str, run_dir: str, compute, link, timeout: float,
                 hosts=None, train_dir: Optional[str] = None, seed: Optional[int] = None) -> dict:
    """One strategy's run. ashl.train writes into `train_dir` (default run_dir; with --netns a
    folder under /var/tmp that every host sees), copied into run_dir when the run ends."""
    os.makedirs(run_dir, exist_ok=True)
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary_path):
        os.remove(summary_path)   # a stale result must not pass for this run's
    train_dir = train_dir or run_dir
    if train_dir != run_dir:
        shutil.rmtree(train_dir, ignore_errors=True)
        os.makedirs(train_dir)
    cmd = train_command(args, strategy, train_dir, compute, link, hosts, seed)
    log_path = os.path.join(run_dir, "log.txt")
    t0 = time.monotonic()
    status, error = launch(cmd, log_path, timeout, copy_back=(train_dir, run_dir))
    if status == "ok" and not os.path.exists(summary_path):
        status, error = "failed", "no summary.json"
    result = {"strategy": strategy, "status": status, "launch_s": round(time.monotonic() - t0, 2),
              "run_dir": run_dir, "seed": args.seed if seed is None else seed}
    if status != "ok":
        result["error"] = f"{error}; last lines of {log_path}:\n" + _tail(log_path, 15)
        rows = _metrics(run_dir)
        if rows:   # what a timed-out run got to is still worth a curve
            result["time_to_target_s"] = _time_to_target(rows, args.target_accuracy)
        return result
    result.update(read_summary(run_dir, args.target_accuracy))
    return result


def launch(cmd: Sequence[str], log_path: str, timeout: float,
           copy_back: tuple[str, str]) -> tuple[str, Optional[str]]:
    """Run `cmd` in its own process group, its output into `log_path`, killed after
    `timeout`; then copy folder copy_back[0] into copy_back[1] (if they differ). Returns
    (status, error): ("ok", None), ("timeout", why) or ("failed", why)."""
    src, dst = copy_back
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_mpi_env(),
                                    start_new_session=True)
        except OSError as e:
            return "failed", f"cannot start {cmd[0]}: {e}"
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return "timeout", f"killed after {timeout:g} s"
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            if src != dst and os.path.isdir(src):
                shutil.copytree(src, dst, dirs_exist_ok=True)
    return ("ok", None) if rc == 0 else ("failed", f"exit status {rc}")


def read_summary(run_dir: str, target: float) -> dict:
    """A finished run's numbers, from its summary.json and metrics.jsonl."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        s = json.load(f)
    return dict(time_to_target_s=_time_to_target(_metrics(run_dir), target),
                **{key: s.get(key) for key in ("final_accuracy", "utilization", "busy", "bytes_sent",
                                               "commits", "local_steps", "wall_s", "stop_reason")},
                **figures.throughput(s))


def _tail(path: str, n: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _metrics(run_dir: str) -> list[dict]:
    from ..train import read_metrics
    return read_metrics(os.path.join(run_dir, "metrics.jsonl"))


def _time_to_target(rows, target: float) -> Optional[float]:
    from ..train import time_to_target
    return time_to_target(rows, target)


def speedups(results: Sequence[dict], of: str) -> tuple[dict, dict]:
    """{other: other's time to target / of's} where both reached it; and, for the others
    that missed it within their wall time, {other: lower bound wall / of's}."""
    mine = next((r for r in results if r["strategy"] == of), None)
    exact, at_least = {}, {}
    if mine is None or mine.get("time_to_target_s") is None:
        return exact, at_least
    t = max(mine["time_to_target_s"], 1e-9)
    for r in results:
        if r["strategy"] == of:
            continue
        if r.get("time_to_target_s") is not None:
            exact[r["strategy"]] = round(r["time_to_target_s"] / t, 3)
        else:
            exact[r["strategy"]] = None
            if r.get("status") == "ok" and r.get("wall_s"):
                at_least[r["strategy"]] = round(r["wall_s"] / t, 3)
    return exact, at_least


SPEEDUP_LEVEL = 0.9         # the bootstrap interval's coverage


def speedup_interval(mine: Sequence[float], other: Sequence[float], *,
                     level: float = SPEEDUP_LEVEL, resamples: int = 2000,
                     seed: int = 0) -> Optional[tuple[float, float]]:
    """How far median(other) / median(mine), times to target over seeds, would move with
    other seeds: a percentile bootstrap (each side's seeds drawn again with replacement,
    `resamples` times; the middle `level` of the ratios). inf is a seed that missed the
    target (a resample whose two medians both missed counts as 1). None with fewer than 3
    seeds on a side. Deterministic for a `seed`."""
    if min(len(mine), len(other)) < 3:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        a = statistics.median(rng.choices(mine, k=len(mine)))
        b = statistics.median(rng.choices(other, k=len(other)))
        ratios.append(1.0 if a == b == math.inf else b / max(a, 1e-9))
    ratios.sort()
    tail = int(round((1 - level) / 2 * resamples))
    return ratios[tail], ratios[resamples - 1 - tail]


def _seed_times(runs: Sequence[dict]) -> list[float]:
    """Times to target, one per run; inf where a run missed the target or failed."""
    return [math.inf if r.get("status") != "ok" or r.get("time_to_target_s") is None
            else r["time_to_target_s"] for r in runs]


def speedup_intervals(results: Sequence[dict], of: str) -> dict:
    """{other: speedup_interval of its seeds over `of`'s}, where both ran 3 seeds or more."""
    mine = next((r for r in results if r["strategy"] == of), None)
    if mine is None:
        return {}
    out = {}
    for r in results:
        if r is not mine:
            interval = speedup_interval(_seed_times(mine.get("seeds") or [mine]),
                                        _seed_times(r.get("seeds") or [r]))
            if interval is not None:
                out[r["strategy"]] = [round(x, 3) if x < math.inf else None for x in interval]
    return out


def _interval_text(interval: Optional[Sequence]) -> str:
    if not interval:
        return ""
    lo, hi = ("inf" if x is None else f"{x:.2f}" for x in interval)
    return f" [{lo}-{hi}]"


def table(results: Sequence[dict], target: float, of: Optional[str],
          exact: dict, at_least: dict, intervals: Optional[dict] = None) -> str:
    head = ["strategy", f"time to {target:g} [s]", "final acc", "util mean", "util min",
            "busy min", "of ideal", "MB sent", "commits", "wall [s]", "overruns"]
    if of:
        head.append(f"{of} speedup")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in results:
        if r.get("status") != "ok":
            row = [r["strategy"], r["status"].upper()] + [""] * (len(head) - 2)
        else:
            util, busy = r.get("utilization") or [], r.get("busy") or []
            row = [r["strategy"], _time_cell(r), _accuracy_cell(r),
                   f"{sum(util) / len(util):.0%}" if util else "-",
                   f"{min(util):.0%}" if util else "-",
                   f"{min(busy):.0%}" if busy else "-",
                   _fraction_cell(r),
                   f"{(r.get('bytes_sent') or 0) / 1e6:.1f}",
                   str(r.get("commits", "-")),
                   "-" if r.get("wall_s") is None else f"{r['wall_s']:.1f}",
                   _overrun_cell(r)]
            if of:
                if r["strategy"] == of:
                    row.append("1.00")
                elif exact.get(r["strategy"]) is not None:
                    row.append(f"{exact[r['strategy']]:.2f}x"
                               + _interval_text((intervals or {}).get(r["strategy"])))
                elif r["strategy"] in at_least:
                    row.append(f"> {at_least[r['strategy']]:.2f}x")
                else:
                    row.append("-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _time_cell(r: dict) -> str:
    ttt, span = r.get("time_to_target_s"), r.get("time_to_target_range")
    text = "missed" if ttt is None else f"{ttt:.2f}"
    if span:
        lo, hi = ("missed" if x is None else f"{x:.2f}" for x in span)
        text += f" [{lo}-{hi}]"
    failed = r.get("seeds_run", 0) - r.get("seeds_ok", 0)
    return text + (f" ({failed} of {r['seeds_run']} seeds failed)" if failed else "")


def _fraction_cell(r: dict) -> str:
    """Throughput as a fraction of the ideal (every rank at its own speed, never waiting)."""
    f = r.get("throughput_fraction")
    if f is None:
        return "-"
    span = r.get("throughput_fraction_range")
    return f"{f:.0%}" + (f" [{span[0]:.0%}-{span[1]:.0%}]" if span else "")


def _overrun_cell(r: dict) -> str:
    """Emulated steps whose real work overran the step time: a loaded machine shows here."""
    steps = r.get("emulated_steps") or 0
    return "-" if not steps else f"{r.get('overruns', 0) / steps:.1%}"


def _accuracy_cell(r: dict) -> str:
    if r.get("final_accuracy") is None:
        return "-"
    span = r.get("final_accuracy_range")
    return f"{r['final_accuracy']:.4f}" + (f" [{span[0]:.4f}-{span[1]:.4f}]" if span else "")


def plot(results: Sequence[dict], path: str, target: float, title: str) -> list[str]:
    """The accuracy curves at `path`; beside it (.utilization.png, .rounds.png) every rank's
    utilisation and one round of each strategy. Returns the files written."""
    curves = []
    for r in results:
        ttt = r.get("time_to_target_s")
        label = r["strategy"] + (f" ({ttt:.1f} s)" if ttt is not None else " (missed)")
        if r.get("status") != "ok":
            label += f" [{r['status']}]"
        curves.append((label, _metrics(r["run_dir"]) if r.get("run_dir") else []))
    figures.plot_accuracy(curves, path, target, title)
    stem = os.path.splitext(path)[0]
    bars, rounds = stem + ".utilization.png", stem + ".rounds.png"
    figures.plot_utilization([(r["strategy"], r.get("utilization") or []) for r in results],
                             bars, f"utilisation, {title}")
    figures.plot_round_timelines(
        [(r["strategy"], os.path.join(r["run_dir"], "timeline.json"))
         for r in results if r.get("run_dir")], rounds, f"one round, {title}")
    return [p for p in (path, bars, rounds) if os.path.exists(p)]


def _netns_rates(args, link: Sequence[float]) -> list[str]:
    """--netns: every rank's link rate (tc text); OptionError: why the mode cannot run here."""
    from .. import netns
    if args.link_base:
        raise OptionError(f"--link-base {args.link_base!r} has no meaning with --netns (the links "
                          "are real): set the factor-1 link with --netns-rate")
    try:
        base = netns.parse_rate(args.netns_rate)
    except ValueError as e:
        raise OptionError(f"--netns-rate {e}") from None
    if args.ranks > netns.MAX_HOSTS:
        raise OptionError(f"--netns --ranks {args.ranks}: at most {netns.MAX_HOSTS} hosts fit "
                          f"{netns.SUBNET}")
    if not netns.is_root():
        raise OptionError("--netns needs root (it creates network namespaces and tc qdiscs)")
    if shutil.which("ip") is None:
        raise OptionError("--netns needs `ip netns` (iproute2), and `ip` is not installed")
    reason = netns.skip_reason()
    if reason:
        first = reason.strip().splitlines()[0]
        raise OptionError(f"--netns: cannot emulate hosts here: {first}")
    busy = netns.namespaces_in_use()
    if busy:   # the names are machine-wide: re-making them would cut another run's hosts off
        raise OptionError("--netns: the emulated hosts are in use by another run (" +
                          "; ".join(f"{n}: pids {' '.join(map(str, p[:5]))}"
                                    for n, p in busy.items()) + "); wait for it to end")
    return [netns.format_rate(base / f) for f in link]


class _NetnsHosts:
    """One emulated host per rank, rank i's link shaped to rates[i], and a work folder under
    /var/tmp (every host has a private /tmp). Yields (hosts, work); on leaving - normally, on an
    error, Ctrl-C or SIGTERM - stops any process left in the hosts, deletes every namespace and
    the work folder."""

    def __init__(self, n: int, rates: Sequence[str]):
        self.n, self.rates = n, list(rates)
        self.hosts = self.work = None

    def __enter__(self):
        import tempfile

        from .. import netns
        try:
            base = "/var/tmp" if os.path.isdir("/var/tmp") else None
            self.work = tempfile.mkdtemp(prefix="ashl-e2e-netns-", dir=base)
            os.chmod(self.work, 0o755)
            self.hosts = netns.Hosts(self.n, tmp_base=os.path.join(self.work, "tmp"))
            self.hosts.create()
            for i, rate in enumerate(self.rates):
                self.hosts.shape(i, rate)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.hosts, self.work

    def __exit__(self, *exc) -> None:
        if self.hosts is not None:
            self.hosts.stop_processes()
            self.hosts.destroy()
        if self.work:
            shutil.rmtree(self.work, ignore_errors=True)


@contextlib.contextmanager
def sigterm_unwinds():
    """SIGTERM raises SystemExit inside the block, so a benchmark that is killed still kills
    the run it launched (its own process group) and removes any hosts it made."""
    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)
    try:
        old = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:                   # not the main thread: nothing to trap
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class _no_hosts:
    def __enter__(self):
        return None, None

    def __exit__(self, *exc) -> None:
        return None


@dataclass
class Setup:
    """The benchmark's checked options: what runs, on which emulated cluster."""
    names: list[str]                # the strategies, in order
    seeds: list[int]                # each strategy runs once per seed
    compute: list[float]            # per-rank compute slowdown
    link: list[float]               # per-rank link slowdown
    timeout: float                  # seconds before a run is killed
    rates: Optional[list[str]]      # --netns: per-rank link rate (tc), else None


def check(args) -> Setup:
    """Every option, before anything runs; a bad one raises OptionError."""
    names = parse_strategies(args.strategies, default_strategies())
    args.transport = getattr(args, "transport", None)   # None: ashl.train's default
    check_transport(args.transport)
    args.device = check_device(args.device)
    if args.ranks < 1:
        raise OptionError(f"--ranks {args.ranks}: must be >= 1")
    # Under --hostfile, a cifar10:DIR need not exist here, only on the hosts.
    check_run_options(args, dataset_must_exist=args.hostfile is None)
    if args.homogeneous:
        compute, link = [1.0] * args.ranks, [1.0] * args.ranks
    else:
        compute = rank_factors("--compute-slowdown", args.compute_slowdown, args.ranks)
        link = rank_factors("--link-slowdown", args.link_slowdown, args.ranks)
    if not args.netns:
        parse_link(args.link_base)   # --netns refuses any --link-base (_netns_rates)
        if args.link_base is None and args.step_time:
            args.link_base = matched_link_base(args)
    if args.hostfile is not None:
        check_hostfile(args)
    timeout = args.timeout if args.timeout is not None else args.max_seconds + 120
    if not (math.isfinite(timeout) and timeout > 0):
        raise OptionError(f"--timeout {timeout:g}: must be a finite number > 0")
    rates = _netns_rates(args, link) if args.netns else None
    return Setup(names, parse_seeds(args.seeds, args.seed), compute, link, timeout, rates)


def matched_link_base(args) -> str:
    """--link-base's default with GPU-like steps: the link that keeps ResNet-18-on-V100s'
    communication/computation ratio for this model (ashl.bench.scenario)."""
    try:
        nbytes = default_scenario.model_bytes(args.model, args.dataset)
    except ValueError as e:
        raise OptionError(f"--model {args.model!r}: {e}") from None
    link = default_scenario.matched_link(nbytes, args.step_time)
    return f"{link.latency_s:g},{link.bytes_per_s:.6g}"


def parse_distinct_ints(option: str, text: str, minimum: int) -> list[int]:
    """'0,1,2' -> [0, 1, 2], in the order given: distinct integers >= `minimum`, or an
    OptionError naming `option`."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise OptionError(f"{option} {text!r}: expected comma-separated integers") from None
    if not values or min(values) < minimum or len(set(values)) != len(values):
        raise OptionError(f"{option} {text!r}: expected distinct integers >= {minimum}")
    return values


def parse_seeds(text: Optional[str], seed: int) -> list[int]:
    """--seeds '0,1,2' -> [0, 1, 2]; None: [seed]. Each a distinct integer >= 0."""
    return [seed] if text is None else parse_distinct_ints("--seeds", text, 0)


def check_hostfile(args) -> None:
    from ..hostfile import HostfileError, parse_hostfile
    if args.netns:
        raise OptionError(f"--hostfile {args.hostfile!r}: --netns makes its own hosts")
    try:
        slots = sum(h.slots for h in parse_hostfile(args.hostfile))
    except HostfileError as exc:
        raise OptionError(f"--hostfile {args.hostfile!r}: {exc}") from None
    if slots < args.ranks:
        raise OptionError(f"--hostfile {args.hostfile!r}: {slots} slots for --ranks {args.ranks}")


def scenario(args, setup: Setup) -> dict:
    """The report's "scenario": everything the runs had in common."""
    sc = {
        "name": "homogeneous" if args.homogeneous else "heterogeneous",
        "ranks": args.ranks, "compute_slowdown": setup.compute, "link_slowdown": setup.link,
        "link_base": (None if args.netns else
                      args.link_base or f"{DEFAULT_LINK.latency_s:g},{DEFAULT_LINK.bytes_per_s:g}"),
        "netns": bool(args.netns),
        # the parameter-server strategies' commits overlap (None: each one's default)
        "overlap": args.overlap,
        "model": args.model, "dataset": args.dataset, "seed": args.seed, "seeds": setup.seeds,
        "batch_size": args.batch_size, "lr": args.lr, "step_time_s": args.step_time,
        "device": args.device,
        "comm_compute_ratio": _comm_compute_ratio(args),
        "target_accuracy": args.target_accuracy, "max_seconds": args.max_seconds,
        "stop_at_target": not args.full_budget, "timeout_s": setup.timeout,
        "strategies": setup.names, "host": platform.node(), "cpus": os.cpu_count(),
        "transport": getattr(args, "transport", None),
    }
    if args.netns:
        from .. import netns
        sc.update(netns_rate=args.netns_rate, link_rates=setup.rates,
                  link_bits_per_s=[netns.parse_rate(r) for r in setup.rates],
                  hosts=[f"{netns.PREFIX}{i}" for i in range(args.ranks)],
                  addresses=[netns.address(i) for i in range(args.ranks)])
    return sc


def _comm_compute_ratio(args) -> Optional[float]:
    """The factor-1 link's time to move the model, over the factor-1 step time."""
    if args.netns or not args.step_time:
        return None
    link = parse_link(args.link_base)
    nbytes = default_scenario.model_bytes(args.model, args.dataset)
    return round(link.delay(nbytes) / args.step_time, 3)


def _links_text(args, setup: Setup) -> str:
    if args.netns:
        return f"shaped links (netns) {args.netns_rate} / x{format_factors(setup.link)}"
    return f"link x{format_factors(setup.link)}"


def announce(args, setup: Setup) -> None:
    print(f"e2e: {len(setup.names)} strategies on {args.ranks} ranks, {args.model}/{args.dataset}, "
          f"compute x{format_factors(setup.compute)}, {_links_text(args, setup)}, "
          f"target {args.target_accuracy:g}, budget {args.max_seconds:g} s each", flush=True)
    if args.netns:
        print(f"     hosts ashl-h0..h{args.ranks - 1}, link rates {', '.join(setup.rates)} "
              "(tbf on both ends)", flush=True)


def run_dir_name(name: str, seed: int, seeds: Sequence[int]) -> str:
    """A run's folder: the strategy's name made path-safe, and its seed when there are several."""
    safe = re.sub(r"[^A-Za-z0-9.+-]+", "_", name).strip("_")
    return safe if len(seeds) == 1 else os.path.join(safe, f"seed{seed}")


def run_all(args, setup: Setup, out: str) -> list[dict]:
    """Every strategy in turn, once per seed (on --netns hosts made for the occasion); one
    line per run; a result per strategy (its seeds combined)."""
    results = []
    hosts_made = _NetnsHosts(args.ranks, setup.rates) if args.netns else _no_hosts()
    with sigterm_unwinds(), hosts_made as (hosts, work):
        for name in setup.names:
            runs = []
            for seed in setup.seeds:
                sub = run_dir_name(name, seed, setup.seeds)
                train_dir = os.path.join(work, "runs", sub) if work else None
                t0 = time.monotonic()
                r = run_strategy(args, name, os.path.join(out, sub), setup.compute, setup.link,
                                 setup.timeout, hosts, train_dir, seed)
                if hosts is not None:
                    stray = hosts.stop_processes()
                    if stray:
                        r["stray_pids_stopped"] = len(stray)
                runs.append(r)
                _print_run(name, seed, r, time.monotonic() - t0)
            results.append(combine_seeds(runs))
    return results


def _print_run(name: str, seed: int, r: dict, seconds: float) -> None:
    if r["status"] == "ok":
        ttt = r.get("time_to_target_s")
        print(f"  {name:10s} seed {seed}: time to target "
              f"{'missed' if ttt is None else f'{ttt:.2f} s'}, final accuracy "
              f"{r['final_accuracy']:.4f} ({seconds:.0f} s with start-up)", flush=True)
    else:
        print(f"  {name:10s} seed {seed}: {r['status'].upper()}: {r['error']}", flush=True)


def combine_seeds(runs: Sequence[dict]) -> dict:
    """One strategy's seeds as one result: medians of every figure, with [min, max] of the
    time to target and the final accuracy; a seed that missed the target, failed or timed
    out counts as slower than every seed that reached it (the median is "missed" if half or
    more did). The other figures are the medians of the seeds that ran to the end. A single
    run is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    ok = [r for r in runs if r["status"] == "ok"]
    first = ok[0] if ok else runs[0]
    out = {"strategy": first["strategy"], "status": "ok" if ok else first["status"],
           "run_dir": first["run_dir"], "seeds": list(runs),
           "seeds_ok": len(ok), "seeds_run": len(runs)}
    if not ok:
        out["error"] = first.get("error")
        return out
    inf = float("inf")
    times = sorted(_seed_times(runs))   # a seed that failed did not reach the target either
    mid = statistics.median(times)
    out["time_to_target_s"] = None if mid == inf else mid
    out["time_to_target_range"] = [times[0] if times[0] < inf else None,
                                   times[-1] if times[-1] < inf else None]
    out["missed_seeds"] = sum(t == inf for t in times)
    accs = [r["final_accuracy"] for r in ok if r.get("final_accuracy") is not None]
    if accs:
        out["final_accuracy"] = statistics.median(accs)
        out["final_accuracy_range"] = [min(accs), max(accs)]
    for key in ("bytes_sent", "commits", "local_steps", "wall_s", "samples_per_s",
                "ideal_samples_per_s", "throughput_fraction"):
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
            if key == "throughput_fraction":
                out["throughput_fraction_range"] = [min(values), max(values)]
    for key in ("emulated_steps", "overruns"):   # summed: a fraction of all the seeds' steps
        out[key] = sum(r.get(key) or 0 for r in ok)
    for key in ("utilization", "busy"):        # per rank, each the median over the seeds
        per_seed = [r[key] for r in ok if r.get(key)]
        if per_seed:
            out[key] = [statistics.median(u) for u in zip(*per_seed)]
    out["stop_reason"] = first.get("stop_reason")
    return out


def write_report(args, setup: Setup, sc: dict, results: list[dict], json_path: str) -> None:
    """The JSON report, the Markdown table and the plot beside it; the table printed."""
    names = setup.names
    of = next((s for s in ASHL_FAMILY if s in names), None)
    exact, at_least = speedups(results, of) if of else ({}, {})
    intervals = speedup_intervals(results, of) if of else {}
    report = {"scenario": sc, "results": results,
              "speedup_of": of, "speedup_vs": exact, "speedup_at_least_vs": at_least,
              "speedup_interval_vs": intervals, "speedup_interval_level": SPEEDUP_LEVEL,
              "speedups": {s: speedups(results, s)[0] for s in ASHL_FAMILY if s in names}}
    with open(json_path, "w") as f:
        json.dump(report, f, indent=1)
    md = table(results, args.target_accuracy, of, exact, at_least, intervals)
    scen = (f"{sc['name']}: {args.ranks} ranks, compute x{format_factors(setup.compute)}, "
            f"{_links_text(args, setup)}, {args.model}/{args.dataset}, "
            f"seed{'s' if len(setup.seeds) > 1 else ''} {','.join(map(str, setup.seeds))}")
    stem = os.path.splitext(json_path)[0]
    with open(stem + ".md", "w") as f:
        f.write(f"# ashl e2e ({scen})\n\n{md}\n")
    try:
        pngs = plot(results, stem + ".png", args.target_accuracy, f"e2e, {scen}")
    except Exception as e:
        print(f"e2e: could not draw the plots: {e}", file=sys.stderr)
        pngs = []
    print(f"\n{md}\n")
    print(f"results: {json_path}\ntable:   {stem}.md")
    for png in pngs:
        print(f"plot:    {png}")


def run(args) -> int:
    try:
        setup = check(args)
    except OptionError as e:
        return _error(str(e))
    json_path = os.path.abspath(args.json)
    out = os.path.abspath(args.out) if args.out else os.path.dirname(json_path)
    os.makedirs(out, exist_ok=True)
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    sc = scenario(args, setup)
    announce(args, setup)
    results = run_all(args, setup, out)
    write_report(args, setup, sc, results, json_path)
    failed = [r["strategy"] for r in results if r["status"] != "ok"]
    if failed:
        print(f"e2e: {len(failed)} strateg{'y' if len(failed) == 1 else 'ies'} failed: "
              f"{', '.join(failed)} (see each run's log.txt)", file=sys.stderr)
        return 1
    return 0
