"""Soak: many fault-tolerant runs (4 GPU-like uneven ranks, ``python -m ashl.run mpirun
--enable-recovery ... python -m ashl.train --fault-tolerant``), each losing one or two
workers to kill -9 at a random point, or its server. Every run must end by itself (no hang);
with workers killed, nothing merged may be lost (tests/mpi/faults.accounting_problems); with
the server killed, every rank must be out within 30 s. Prints one line per run and the
figures.

    python tests/soak/fault_soak.py [--runs 50] [--seed 0] [--server-kills 0.1]
"""
import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
from faults import TARGET, Job, accounting_problems, commits_at_least  # noqa: E402

HANG_S = 150          # a run that has not ended this long after its last kill hung
SERVER_OUT_S = 30     # every rank out this soon after the server's death


def near_the_end(job: Job) -> bool:
    """The run's accuracy is within half a point of its target: it may stop any moment."""
    rows = job.rows()
    return bool(rows) and (rows[-1].get("accuracy") or 0) >= TARGET - 0.005


def one_run(rng: random.Random, out: Path, server_kill_p: float) -> dict:
    job = Job(out, 4, "--max-seconds", "120", "--seed", str(rng.randrange(1000)))
    server = rng.random() < server_kill_p
    victims = [0] if server else rng.sample([1, 2, 3], rng.choice([1, 1, 2]))
    killed, record = [], {"victims": victims, "server": server}
    try:
        for v in victims:
            at = rng.randrange(3, 150)
            job.wait_for(f"{at} commits", commits_at_least(at), timeout=90)
            if near_the_end(job):
                break      # a rank told to stop is not lost: kills after that prove nothing
            if v in job.rank_pids():
                job.kill(v)
                killed.append((v, time.monotonic()))
    except AssertionError:
        pass       # the run ended before the kill point: a run without (some) faults
    t_kill = killed[-1][1] if killed else time.monotonic()
    try:
        rc = job.finish(SERVER_OUT_S if server and killed else HANG_S)
        record.update(rc=rc, hung=False, out_s=time.monotonic() - t_kill)
    except AssertionError:
        record.update(rc=None, hung=True, out_s=None)
        return record
    lost = [v for v, _ in killed]
    record["killed"] = lost
    if server and killed:
        record["problems"] = [] if rc == 1 else [f"status {rc} after the server's death"]
    else:
        record["problems"] = accounting_problems(job, lost)
        if rc != (3 if lost else 0):
            record["problems"].append(f"status {rc}")
    return record


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-kills", type=float, default=0.1,
                   help="fraction of runs whose server is killed instead of workers")
    p.add_argument("--keep", action="store_true", help="keep the runs' folders")
    args = p.parse_args()
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="ashl-fault-soak-"))
    records = []
    for i in range(args.runs):
        r = one_run(rng, base / f"run{i}", args.server_kills)
        records.append(r)
        print(f"run {i:3d}: killed {r.get('killed', [])} {'(server)' if r['server'] else ''} "
              f"status {r['rc']} out in {r['out_s'] and round(r['out_s'], 1)} s "
              f"{'HUNG' if r['hung'] else ''} {'; '.join(r.get('problems', []))}", flush=True)
    hung = sum(r["hung"] for r in records)
    bad = [r for r in records if r.get("problems")]
    workers = [r for r in records if not r["server"] and r.get("killed")]
    servers = [r for r in records if r["server"] and r.get("killed")]
    outs = sorted(r["out_s"] for r in servers if r["out_s"] is not None)
    server_line = (f", all ranks out {outs[0]:.1f}-{outs[-1]:.1f} s after the kill"
                   if outs else "")
    print(f"\n{len(records)} runs: {hung} hung, {len(bad)} with problems (lost merges, wrong "
          f"status, missed target); {len(workers)} runs lost workers "
          f"({sum(len(r['killed']) for r in workers)} kills); {len(servers)} lost their "
          f"server{server_line}")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if hung or bad else 0


if __name__ == "__main__":
    sys.exit(main())
