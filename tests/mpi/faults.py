"""Real faults in real runs: a fault-tolerant ``python -m ashl.train`` under
``python -m ashl.run mpirun --enable-recovery``, and a kill -9 of chosen ranks at chosen
points of the run (read from rank 0's metrics.jsonl as it is written)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import psutil

from _util import mpi_env

# GPU-like steps (20 ms x factor) on uneven ranks, so the plan is the same on a busy
# machine; a small learning rate, so the target takes 10-20 s and there is time to kill.
ENV = {"ASHL_EMULATE_STEP_TIME": "0.02", "OMP_NUM_THREADS": "1"}
TARGET = 0.96
TRAIN = ("--model", "mlp", "--dataset", "digits", "--compute-slowdown", "1,1,2,4", "--lr", "0.01",
         "--target-accuracy", str(TARGET), "--eval-every", "0.2", "--no-progress")



def rank_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of every rank process under `launcher_pid` alive now (from its Open MPI
    environment)."""
    out = {}
    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for child in children:
        try:
            rank = child.environ().get("OMPI_COMM_WORLD_RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None and "python" in child.name():
            out[int(rank)] = child.pid
    return out

class Job:
    """One launched job: its process, its output folder, its ranks' pids."""

    def __init__(self, out: Path, np_: int, *train_args, launcher="mpirun", env=None,
                 script=None):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        program = ([str(script), str(self.out)] if script is not None else
                   ["-m", "ashl.train", "--fault-tolerant", "--out", str(self.out), *TRAIN])
        launch = {   # the two launch recipes of docs/LAUNCHING.md
            "mpirun": ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
                       "--enable-recovery"],
            "horovodrun": [str(Path(sys.executable).parent / "horovodrun"), "-np", str(np_),
                           "-H", f"localhost:{np_}",
                           "--mpi-args=--enable-recovery --oversubscribe --bind-to none"],
        }[launcher]
        cmd = [sys.executable, "-m", "ashl.run", "--status-dir", str(self.out / "status"),
               *launch, sys.executable, *program, *map(str, train_args)]
        full_env = mpi_env()
        full_env.update(ENV, **(env or {}))
        self.log = open(self.out / "job.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)
        self.np = np_
        self.started = time.monotonic()

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of every rank process alive now (from its Open MPI environment)."""
        return rank_pids(self.proc.pid)

    def replacement(self, *train_args) -> subprocess.Popen:
        """A replacement for a lost rank: the same job's command, started alone (no launcher)
        with ASHL_JOIN set to the address the run announced."""
        address = (self.out / "join_address").read_text().strip()
        env = mpi_env()
        env.update(ENV, ASHL_JOIN=address)
        self.replacement_log = open(self.out / "replacement.log", "w")
        return subprocess.Popen([sys.executable, "-m", "ashl.train", "--fault-tolerant", "--out",
                                 str(self.out), *TRAIN, *map(str, train_args)],
                                stdout=self.replacement_log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)

    def wait_for_text(self, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while what not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never saw {what!r}:\n" + self.text()[-4000:])
            time.sleep(0.05)

    def rows(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()
                if line.strip().endswith("}")]

    def wait_for(self, what: str, ok: Callable[[list[dict]], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ok(self.rows()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never saw {what} (job ended: {self.proc.poll()}):\n"
                                     + self.text()[-4000:])
            time.sleep(0.05)

    def kill(self, rank: int) -> float:
        """kill -9 of `rank`; the time of the kill."""
        pid = self.rank_pids()[rank]
        os.kill(pid, signal.SIGKILL)
        return time.monotonic()

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError("the job hung:\n" + self.text()[-4000:])
        finally:
            self.log.close()

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.out / "job.log").read_text(errors="replace")

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def rank_result(self, rank: int) -> Optional[dict]:
        path = self.out / f"rank{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None


def commits_at_least(n: int):
    return lambda rows: any((r.get("commits") or 0) >= n for r in rows)


def in_stage(stage: str):
    return lambda rows: any(r.get("stage") == stage for r in rows)


def accounting_problems(job: Job, lost: list[int], target: float = TARGET) -> list[str]:
    """What is wrong with a finished fault-tolerant run that lost the ranks `lost`: it
    must reach `target` without them, name them, and have merged exactly what each worker
    was told it merged (a lost one: what the server counted for it). [] if nothing."""
    if not (job.out / "summary.json").exists():
        return ["no summary.json"]
    summary, out = job.summary(), []
    if not (summary["stop_reason"] or "").startswith("target accuracy"):
        out.append(f"stopped by {summary['stop_reason']!r}")
    if summary["final_accuracy"] < target:
        out.append(f"final accuracy {summary['final_accuracy']:.4f} < {target}")
    if sorted(x["rank"] for x in summary["lost_ranks"]) != sorted(lost):
        out.append(f"lost {[x['rank'] for x in summary['lost_ranks']]}, expected {lost}")
    server = summary["per_rank"][0]["counters"]["server"]
    if sum(server["merged_by"]) != server["merged"]:
        out.append(f"merged_by {server['merged_by']} does not add up to {server['merged']}")
    for r in range(job.np):
        if r in lost:
            record = next((x for x in summary["lost_ranks"] if x["rank"] == r), None)
            if job.rank_result(r) is not None:
                out.append(f"lost rank {r} wrote a result")
            if record is None or record["merged"] != server["merged_by"][r]:
                out.append(f"lost rank {r}: the server counted {server['merged_by'][r]} merged, "
                           f"the record says {record and record['merged']}")
            continue
        result = job.rank_result(r)
        if result is None:
            out.append(f"survivor {r} wrote no result")
        elif result["counters"]["accepted"] != server["merged_by"][r]:
            out.append(f"rank {r} was told {result['counters']['accepted']} merged, the server "
                       f"merged {server['merged_by'][r]}")
        elif result["counters"]["stop_reason"] != summary["stop_reason"]:
            out.append(f"rank {r} stopped for {result['counters']['stop_reason']!r}")
    text = job.text()
    out += [f"no line names lost rank {r}" for r in lost if f"worker rank {r} was lost" not in text]
    return out
