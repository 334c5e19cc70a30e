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
drift and any order effect hit both alike. Then the same plan for the server rank's own
commits (rank 0's main thread to its server thread): ``mpi-self`` (MPI to itself) against
``inproc`` (ZeroMQ's in-process path), while rank 1 waits.

The idle cost (``--hold-s`` > 0): per repeat and transport (mpi, zmq, alternating), rank 1
commits and the server thread holds the reply for ``hold_s``, waiting for a next commit
that does not come (as it waits between commits, or holds an SHL reply), then answers.
Over that window: the server thread's CPU time (``time.thread_time``) and voluntary context
switches (its wake-ups, ``RUSAGE_THREAD``), and the waiting rank's process CPU time (its
transport's threads included) and wake-ups of its waiting thread.

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
import resource
import threading
import time
from typing import Optional

import torch

from .. import protocol
from ..protocol import DType, Flag, Header, Kind, MessageBuffer
from ..stages import Stage
from ..transport import PeerLost, open_ends

SERVER, CLIENT = 0, 1
TRANSPORTS = ("mpi", "zmq")             # rank 1's commits
SELF_TRANSPORTS = ("mpi-self", "inproc")  # the server rank's own commits
FAMILY = {"mpi": "mpi", "zmq": "zmq", "mpi-self": "mpi", "inproc": "zmq"}
WAIT_S = 120.0   # the server gives up on a commit that does not come (a hung client)
# How often the MPI ends look for a message (they sleep in between): transport.py's default.
DEFAULT_POLL_S = inspect.signature(open_ends).parameters["poll_s"].default


def plan(warmup: int, repeat: int, transports=TRANSPORTS) -> list[tuple[int, str, bool]]:
    """(commit number, transport, timed) of every round trip of one size, in order."""
    rounds = [(name, False) for _ in range(warmup) for name in transports]
    for i in range(repeat):
        order = transports if i % 2 == 0 else transports[::-1]
        rounds += [(name, True) for name in order]
    return [(commit, name, timed) for commit, (name, timed) in enumerate(rounds, start=1)]


def commit_header(numel: int, commit: int, rank: int = CLIENT) -> Header:
    return Header(kind=Kind.DENSE_DELTA, rank=rank, stage=Stage.AHL, dtype=DType.FLOAT32,
                  numel=numel, commit=commit)


def wakeups() -> int:
    """This thread's voluntary context switches so far: each is a wait it woke from."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def intact(reply: protocol.Message, commit: int, sent: torch.Tensor) -> bool:
    """Whether `reply` answers commit `commit` and carries exactly the bytes of `sent`."""
    h = reply.header
    return (h.kind == Kind.REPLY and h.base_version == commit
            and reply.payload.numel() == sent.numel() * sent.element_size()
            and torch.equal(reply.payload, sent.view(torch.uint8)))


# ------------------------------------------------------------------------------ server

def next_commit(server):
    """The next commit on `server` (a ServerEnd), polled as ServerThread polls (0.25 s)."""
    deadline = time.monotonic() + WAIT_S
    event = None
    while event is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no commit in {WAIT_S:g} s")
        event = server.poll(0.25)
        if isinstance(event, PeerLost):
            raise RuntimeError(f"lost rank {event.rank}: {event.why}")
    return event


def hold(server, hold_s: float) -> dict:
    """Wait `hold_s` for a commit that does not come, as ServerThread waits (0.25 s polls
    between its ticks); this thread's CPU seconds and wake-ups meanwhile."""
    cpu, woke, t0 = time.thread_time(), wakeups(), time.monotonic()
    while (left := hold_s - (time.monotonic() - t0)) > 0:
        if server.poll(min(0.25, left)) is not None:
            raise RuntimeError("a commit came while the server held a reply")
    return {"wall_s": time.monotonic() - t0, "cpu_s": time.thread_time() - cpu,
            "wakeups": wakeups() - woke}


def answer(server, hold_s: float = 0.0) -> "dict | None":
    """Wait for the next commit on `server` and reply with its payload; with `hold_s`,
    only after holding it that long (hold()'s figures are returned)."""
    event = next_commit(server)
    held = hold(server, hold_s) if hold_s > 0 else None
    h = event.header
    reply = Header(kind=Kind.REPLY, rank=SERVER, stage=h.stage, dtype=h.dtype, numel=h.numel,
                   base_version=h.commit, flags=Flag.ACCEPTED)
    if not server.send(h.rank, reply, event.payload):
        raise RuntimeError(f"rank {h.rank} is unreachable")
    server.drain()   # the next round may be the other transport's: MPI's send moves on
    return held      # only while this process calls MPI (a real server keeps polling)


def serve(ends: dict, rounds: list, hold_s: float = 0.0, main=None) -> list:
    """Answer every round trip of `rounds` from a server thread (each held `hold_s`), while
    `main()` (if any: the server rank's own commits) runs on this thread; the holds'
    figures, in order. An error of either is raised here."""
    errors: list[BaseException] = []
    held: list = []

    def loop():
        try:
            for _, name, _ in rounds:
                held.append(answer(ends[FAMILY[name]][0], hold_s))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            errors.append(exc)

    thread = threading.Thread(target=loop, name="bench-server", daemon=True)
    thread.start()
    result = None
    try:
        result = main() if main is not None else None
    finally:
        thread.join()
    if errors:
        raise errors[0]
    return held if main is None else result


# ------------------------------------------------------------------------------ client

def client(ends: dict, rounds: list, numel: int, rank: int = CLIENT) -> dict:
    """Every round trip of `rounds` from `rank`: the timed ones' seconds per transport, and
    how many replies (warm-ups included) were not the commit's bytes."""
    base = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    sent = torch.empty_like(base)
    buffer = MessageBuffer(4 * numel)
    names = sorted({name for _, name, _ in rounds})
    times = {name: [] for name in names}
    corrupt = dict.fromkeys(names, 0)
    for commit, name, timed in rounds:
        torch.add(base, commit, out=sent)
        header, end = commit_header(numel, commit, rank), ends[FAMILY[name]][1]
        t0 = time.perf_counter()
        end.send(header, sent)
        reply = end.recv(buffer)
        dt = time.perf_counter() - t0
        corrupt[name] += not intact(reply, commit, sent)
        if timed:
            times[name].append(dt)
    return {"times_s": times, "corrupt": corrupt, "endpoint": ends["zmq"][1].endpoint}


def waiting_client(ends: dict, rounds: list) -> list:
    """The hold rounds from rank 1: per round, its process CPU seconds and its waiting
    thread's wake-ups from the send to the reply."""
    header, buffer, out = commit_header(1, 0), MessageBuffer(4), []
    payload = torch.zeros(1)
    for commit, name, _ in rounds:
        end = ends[FAMILY[name]][1]
        cpu, woke, t0 = time.process_time(), wakeups(), time.monotonic()
        end.send(header.replace(commit=commit), payload)
        end.recv(buffer)
        out.append({"wall_s": time.monotonic() - t0, "cpu_s": time.process_time() - cpu,
                    "wakeups": wakeups() - woke})
    return out


# ------------------------------------------------------------------------------ driver

def close(ends: dict) -> None:
    for server, end in ends.values():
        end.close()
        if server is not None:
            server.close()


def open_both(wire, numel: int, poll_s: float) -> dict:
    """Both transports' ends, by family: (server end on rank 0, this rank's end)."""
    return {name: open_ends(wire, SERVER, numel, transport=name, poll_s=poll_s)
            for name in ("mpi", "zmq")}


def measure(wire, nbytes: int, rounds: list, poll_s: float = DEFAULT_POLL_S,
            self_rounds: Optional[list] = None):
    """One size: rank 1's round trips on both transports, then (`self_rounds`) rank 0's own
    on mpi-self and inproc; the results on rank 0 (rank 1's part is gathered later)."""
    numel = nbytes // 4
    ends = open_both(wire, numel, poll_s)
    try:
        if wire.Get_rank() == SERVER:
            serve(ends, rounds)
        else:
            remote = client(ends, rounds, numel)
        wire.Barrier()
        own = None
        if wire.Get_rank() == SERVER and self_rounds:
            own = serve(ends, self_rounds, main=lambda: client(ends, self_rounds, numel, SERVER))
        wire.Barrier()   # rank 1's end stays open meanwhile: its close is a lost peer
        if wire.Get_rank() == SERVER:
            return {"bytes": nbytes, "self": own}
        return {"bytes": nbytes, **remote, "zmq_endpoint": remote["endpoint"]}
    finally:
        close(ends)
        wire.Barrier()


def measure_idle(wire, hold_s: float, repeat: int, poll_s: float) -> Optional[dict]:
    """The idle cost of both transports (the module's docstring): per transport, the server
    thread's and the waiting rank's figures per round, merged on rank 0."""
    rounds = plan(1, repeat)
    ends = open_both(wire, 1, poll_s)
    try:
        if wire.Get_rank() == SERVER:
            mine = serve(ends, rounds, hold_s)
        else:
            mine = waiting_client(ends, rounds)
    finally:
        close(ends)
    theirs = wire.gather(mine, root=SERVER)
    if wire.Get_rank() != SERVER:
        return None
    out = {name: {"server": [], "waiting": []} for name in TRANSPORTS}
    for (_, name, timed), server, waiting in zip(rounds, theirs[SERVER], theirs[CLIENT]):
        if timed:
            out[name]["server"].append(server)
            out[name]["waiting"].append(waiting)
    return out


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
    p.add_argument("--hold-s", type=float, default=0.0)
    p.add_argument("--hold-repeat", type=int, default=0)
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
    self_rounds = plan(args.warmup, args.repeat, SELF_TRANSPORTS)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = [measure(wire, nbytes, rounds, args.poll_s, self_rounds) for nbytes in sizes]
    idle = (measure_idle(wire, args.hold_s, args.hold_repeat, args.poll_s)
            if args.hold_s > 0 and args.hold_repeat > 0 else None)
    gathered = wire.gather(results, root=SERVER)
    if wire.Get_rank() == SERVER:
        for remote, own in zip(gathered[CLIENT], gathered[SERVER]):
            for key in ("times_s", "corrupt"):
                remote[key].update(own["self"][key])
        with open(args.out, "w") as f:
            json.dump({"environment": environment(MPI), "mpi_poll_s": args.poll_s,
                       "sizes": gathered[CLIENT], "idle": idle, "hold_s": args.hold_s}, f)
    wire.Free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
