"""How soon the fault-tolerant transport sees a rank go: a rank process connects its
ZmqRankEnd to a ZmqServerEnd and commits once; then it is killed (SIGKILL: the kernel closes
its connection) or frozen (SIGSTOP: silent, the connection stays open, only ZeroMQ's
heartbeats stop). Prints the time from the signal to the server's PeerLost, median and
range over the trials.

    python tests/soak/loss_detection.py [--trials 20] [--timeout 2.0]
"""
import argparse
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time

import torch

from ashl import protocol
from ashl.protocol import DType, Header, Kind
from ashl.stages import Stage
from ashl.transport import PeerLost, ZmqRankEnd, ZmqServerEnd

NUMEL = 1024


def rank(port: int, timeout_s: float, ready) -> None:
    end = ZmqRankEnd(f"tcp://127.0.0.1:{port}", 1, NUMEL, world_size=2, server_rank=0,
                     timeout_s=timeout_s)
    end.send(Header(kind=Kind.DENSE_DELTA, rank=1, stage=Stage.AHL, dtype=DType.FLOAT32,
                    numel=NUMEL), torch.zeros(NUMEL))
    ready.set()
    time.sleep(3600)


def one_trial(sig: int, timeout_s: float) -> float:
    server = ZmqServerEnd(2, NUMEL, timeout_s=timeout_s)
    ready = mp.Event()
    proc = mp.Process(target=rank, args=(server.port, timeout_s, ready), daemon=True)
    proc.start()
    while True:   # its commit: the server now knows which connection is rank 1
        event = server.poll(1.0)
        if event is not None and not isinstance(event, PeerLost):
            break
    ready.wait(10)
    t0 = time.monotonic()
    os.kill(proc.pid, sig)
    deadline = t0 + 10 * timeout_s + 5
    while time.monotonic() < deadline:
        event = server.poll(0.05)
        if isinstance(event, PeerLost) and event.rank == 1:
            seen = time.monotonic() - t0
            break
    else:
        seen = float("nan")
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    server.close()
    return seen


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--timeout", type=float, default=2.0, help="the heartbeat timeout (s)")
    args = p.parse_args()
    for name, sig in (("killed (SIGKILL)", signal.SIGKILL), ("frozen (SIGSTOP)", signal.SIGSTOP)):
        times = [one_trial(sig, args.timeout) for _ in range(args.trials)]
        ok = [t for t in times if t == t]
        print(f"{name}: seen by the server after median {statistics.median(ok) * 1e3:.1f} ms "
              f"[{min(ok) * 1e3:.1f}-{max(ok) * 1e3:.1f}] over {len(ok)} of {len(times)} trials "
              f"(heartbeat timeout {args.timeout:g} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
