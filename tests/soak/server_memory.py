"""Soak: the parameter server's memory over a long run must not grow per commit.

Drives ParameterServer.handle in-process (no MPI: the server's own state is what is
measured) with dense AHL commits, then sparse SHL commits, from 4 ranks, and prints the
resident set size at checkpoints.

    python tests/soak/server_memory.py [--commits 200000] [--numel 1000000]
"""
import argparse
import resource
import sys
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_server import dense, server, sparse  # noqa: E402  (the unit tests' builders)

import test_server  # noqa: E402
from ashl.stages import Stage  # noqa: E402


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--commits", type=int, default=200_000)
    p.add_argument("--numel", type=int, default=100_000)
    args = p.parse_args()
    test_server.N = args.numel
    ranks = 4
    s = server(n_ranks=ranks, stage=Stage.SHL, bound=10**9)
    delta = torch.full((args.numel,), 1e-6)
    idx = list(range(0, args.numel, 100))
    vals = torch.full((len(idx),), 1e-6)
    marks = []
    for i in range(args.commits):
        r = i % ranks
        if i % 2:
            s.handle(*dense(r, delta, stage=Stage.SHL, base=s.version))
        else:
            s.handle(*sparse(r, idx, vals, stage=Stage.SHL, base=s.version))
        if i % (args.commits // 10) == 0:
            marks.append((i, rss_mib()))
            print(f"commit {i:>8}: rss {marks[-1][1]:8.1f} MiB", flush=True)
    marks.append((args.commits, rss_mib()))
    growth = marks[-1][1] - marks[1][1]
    print(f"after {args.commits} commits: rss {marks[-1][1]:.1f} MiB, growth since the "
          f"first tenth {growth:+.1f} MiB (peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB)")
    return 0 if growth < 16 else 1


if __name__ == "__main__":
    sys.exit(main())
