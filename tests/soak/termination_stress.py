"""Soak: many short jobs of every strategy with random slowdowns, each under a timeout.
Every job must end by itself and every rank must exit 0.

    python tests/soak/termination_stress.py [--jobs 40] [--ranks 3] [--seed 0]
"""
import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
from _util import mpi_env  # noqa: E402

from ashl.strategies import STRATEGIES  # noqa: E402


def one_job(strategy: str, ranks: int, rng: random.Random, out: Path, timeout: float,
            budgets: list[float]):
    compute = ",".join(str(rng.choice([1, 1, 1.5, 2, 3, 4])) for _ in range(ranks))
    link = ",".join(str(rng.choice([1, 1, 2, 4])) for _ in range(ranks))
    budget = rng.choice(budgets)
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable,
           "-m", "ashl.train", "--strategy", strategy, "--max-seconds", f"{budget:g}",
           "--target-accuracy", str(rng.choice([0.5, 0.9, 0.999])), "--compute-slowdown", compute,
           "--link-slowdown", link, "--seed", str(rng.randrange(1000)), "--no-progress",
           "--out", str(out)]
    env = mpi_env()
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", ""
    if rc != 0 and not tail.strip():
        tail = f"(no output) command: {' '.join(cmd)}"
    return rc, time.monotonic() - t0, f"{strategy} compute={compute} link={link} budget={budget:g}s", tail


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--budgets", default="3,5,8",
                   help="the time budgets [s] a job draws from (the end by budget lands "
                        "in profiling, early training or later)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    strategies = args.strategies.split(",")
    budgets = [float(b) for b in args.budgets.split(",")]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.jobs):
            strategy = strategies[i % len(strategies)]
            rc, seconds, what, tail = one_job(strategy, args.ranks, rng, Path(tmp) / str(i),
                                              args.timeout, budgets)
            ok = rc == 0
            failures += not ok
            print(f"job {i:3d} {'ok  ' if ok else 'FAIL'} {seconds:6.1f} s  rc={rc}  {what}",
                  flush=True)
            if not ok:
                print(tail)
    print(f"{args.jobs - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
