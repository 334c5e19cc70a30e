"""The two ranks of ``python -m ashl.bench transport``, under ``mpirun -np 2`` (started by
:mod:`ashl.bench.transport`; not meant to be run by hand).

Rank 0 is the server. Its server ends are polled by a thread, as ashl's ``ServerThread``
polls them in a real run (the MPI calls come from a thread that is not MPI's main one, under
MPI_THREAD_MULTIPLE); its main thread only waits for that thread (in a real run it trains
meanwhile). Rank 1 is the client.

Per size, both transports are opened with ``transport.open_ends`` (their model size is the
message size: a header's numel must match it), and the round trips of both follow one plan,
known to both ranks: a few warm-up round trips per transport (ZeroMQ connects on the first
one, a large buffer is faulted in on it), then ``repeat`` rounds of one round trip per
transport, in alternating order (mpi first in even rounds, zmq first in odd ones), so that
drift and any order effect hit both alike.

A round trip is what a commit costs the client: ``RankEnd.send`` of a DENSE_DELTA of N
bytes, then ``RankEnd.recv`` of the server's REPLY carrying N bytes, timed from before the
send to after the reply is in the buffer. The server answers with the commit's own payload
(sent from its receive buffer, as it would send the model), and the client compares every
byte of the reply with what it sent, and the reply's base_version with the commit's number.
Each commit's payload differs from the one before (a random base plus the commit's number),
so a stale or partial buffer on either side fails the comparison: one check covers both
directions. A failed round trip is counted in ``corrupt``, and still timed.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import threading
import time

import torch

from .. import protocol
from ..protocol import DType, Flag, Header, Kind, MessageBuffer
from ..stages import Stage
from ..transport import PeerLost, open_ends

SERVER, CLIENT = 0, 1
TRANSPORTS = ("mpi", "zmq")
WAIT_S = 120.0   # the server gives up on a commit that does not come (a hung client)
# How often the MPI ends look for a message (they sleep in between): transport.py's default.
DEFAULT_POLL_S = inspect.signature(open_ends).parameters["poll_s"].default


def plan(warmup: int, repeat: int) -> list[tuple[int, str, bool]]:
    """(commit number, transport, timed) of every round trip of one size, in order."""
    rounds = [(name, False) for _ in range(warmup) for name in TRANSPORTS]
    for i in range(repeat):
        order = TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1]
        rounds += [(name, True) for name in order]
    return [(commit, name, timed) for commit, (name, timed) in enumerate(rounds, start=1)]


def commit_header(numel: int, commit: int) -> Header:
    return Header(kind=Kind.DENSE_DELTA, rank=CLIENT, stage=Stage.AHL, dtype=DType.FLOAT32,
                  numel=numel, commit=commit)


def intact(reply: protocol.Message, commit: int, sent: torch.Tensor) -> bool:
    """Whether `reply` answers commit `commit` and carries exactly the bytes of `sent`."""
    h = reply.header
    return (h.kind == Kind.REPLY and h.base_version == commit
            and reply.payload.numel() == sent.numel() * sent.element_size()
            and torch.equal(reply.payload, sent.view(torch.uint8)))


# ------------------------------------------------------------------------------ server

def answer(server) -> None:
    """Wait for the next commit on `server` (a ServerEnd) and reply with its payload."""
    deadline = time.monotonic() + WAIT_S
    event = None
    while event is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no commit in {WAIT_S:g} s")
        event = server.poll(0.25)
        if isinstance(event, PeerLost):
            raise RuntimeError(f"lost rank {event.rank}: {event.why}")
    h = event.header
    reply = Header(kind=Kind.REPLY, rank=SERVER, stage=h.stage, dtype=h.dtype, numel=h.numel,
                   base_version=h.commit, flags=Flag.ACCEPTED)
    if not server.send(h.rank, reply, event.payload):
        raise RuntimeError(f"rank {h.rank} is unreachable")


def serve(ends: dict, rounds: list) -> None:
    """Answer every round trip of `rounds` from a server thread; its error is raised here."""
    errors: list[BaseException] = []

    def loop():
        try:
            for _, name, _ in rounds:
                answer(ends[name][0])
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            errors.append(exc)

    thread = threading.Thread(target=loop, name="bench-server", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


# ------------------------------------------------------------------------------ client

def client(ends: dict, rounds: list, numel: int) -> dict:
    """Every round trip of `rounds`: the timed ones' seconds per transport, and how many
    replies (warm-ups included) were not the commit's bytes."""
    base = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    sent = torch.empty_like(base)
    buffer = MessageBuffer(4 * numel)
    times = {name: [] for name in TRANSPORTS}
    corrupt = dict.fromkeys(TRANSPORTS, 0)
    for commit, name, timed in rounds:
        torch.add(base, commit, out=sent)
        header, end = commit_header(numel, commit), ends[name][1]
        t0 = time.perf_counter()
        end.send(header, sent)
        reply = end.recv(buffer)
        dt = time.perf_counter() - t0
        corrupt[name] += not intact(reply, commit, sent)
        if timed:
            times[name].append(dt)
    return {"bytes": 4 * numel, "times_s": times, "corrupt": corrupt,
            "zmq_endpoint": ends["zmq"][1].endpoint}


# ------------------------------------------------------------------------------ driver

def close(ends: dict) -> None:
    for server, end in ends.values():
        end.close()
        if server is not None:
            server.close()


def measure(wire, nbytes: int, rounds: list, poll_s: float = DEFAULT_POLL_S):
    """One size on both transports: the client's results on rank 1, None on rank 0."""
    numel = nbytes // 4
    ends = {name: open_ends(wire, SERVER, numel, fault_tolerant=name == "zmq", poll_s=poll_s)
            for name in TRANSPORTS}
    try:
        if wire.Get_rank() == SERVER:
            serve(ends, rounds)
            return None
        return client(ends, rounds, numel)
    finally:
        close(ends)
        wire.Barrier()


def environment(MPI) -> dict:
    import zmq
    return {"host": platform.node(), "cpus": os.cpu_count(),
            "mpi_library": MPI.Get_library_version().splitlines()[0].strip("\x00 "),
            "zmq_version": zmq.zmq_version(), "pyzmq_version": zmq.pyzmq_version(),
            "torch_threads": torch.get_num_threads()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ashl.bench.transport_worker")
    p.add_argument("--sizes", required=True, help="comma-separated bytes, multiples of 4")
    p.add_argument("--repeat", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--poll-s", type=float, default=DEFAULT_POLL_S)
    p.add_argument("--out", required=True, help="rank 0 writes the client's results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from ..strategies.runtime import mpi_world
    args = parse_args(argv)
    MPI = mpi_world()
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        raise SystemExit(f"run on 2 ranks, not {world.Get_size()}")
    wire = world.Dup()
    rounds = plan(args.warmup, args.repeat)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = [measure(wire, nbytes, rounds, args.poll_s) for nbytes in sizes]
    gathered = wire.gather(results, root=SERVER)
    if wire.Get_rank() == SERVER:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(MPI), "mpi_poll_s": args.poll_s,
                   "sizes": gathered[CLIENT]}, f)
    wire.Free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
