"""An in-process world of N ranks (one thread each) with the parts of mpi4py's communicator
and Horovod's collectives that the strategies use, so their control plane is tested
without mpirun: what every rank decides, when it stops, what model it ends with.

    world = FakeWorld(3)
    results = world.run(lambda comm, hvd: ...)     # one call per rank, in threads
"""
from __future__ import annotations

import pickle
import queue
import threading
from collections import defaultdict

import numpy as np
import torch


class _Request:
    def __init__(self, fn):
        self.fn, self.done, self.value = fn, False, None

    def test(self):
        if not self.done:
            self.done, self.value = self.fn()
        return self.done, self.value

    def Wait(self):
        while not self.test()[0]:
            pass
        return self.value

    wait = Wait


class _Group:
    """What the ranks of one communicator share: mailboxes and a collective rendezvous."""

    def __init__(self, size: int, parent: "_Group | None" = None):
        self.size, self.parent = size, parent
        self.boxes = defaultdict(queue.Queue)       # (source, dest, tag) -> messages
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size
        self.lock = threading.Lock()
        self.dups = defaultdict(lambda: None)       # dup number -> _Group
        self.ibarriers = defaultdict(int)           # Ibarrier number -> ranks entered

    def aborted(self) -> bool:
        """A rank failed (FakeWorld.run aborts the world's barrier; a dup's follows it)."""
        return self.barrier.broken or (self.parent is not None and self.parent.aborted())

    def collective(self, rank: int, value):
        """Every rank's value, in rank order, on every rank."""
        self.barrier.wait()
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class FakeComm:
    def __init__(self, group: _Group, rank: int):
        self.group, self.rank = group, rank
        self._dups = 0
        self._ibarriers = 0
        self.freed = False

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.group.size

    def Dup(self):
        self._dups += 1
        with self.group.lock:
            sub = self.group.dups[self._dups]
            if sub is None:
                sub = self.group.dups[self._dups] = _Group(self.group.size, self.group)
        return FakeComm(sub, self.rank)

    def Free(self):
        self.freed = True

    # point to point (pickled objects and raw buffers)
    def send(self, obj, dest, tag=0):
        self.group.boxes[(self.rank, dest, tag)].put(pickle.dumps(obj))

    def isend(self, obj, dest, tag=0):
        self.send(obj, dest, tag)
        return _Request(lambda: (True, None))

    def recv(self, source, tag=0):
        return pickle.loads(self.group.boxes[(source, self.rank, tag)].get(timeout=30))

    def Send(self, buf, dest, tag=0):
        self.group.boxes[(self.rank, dest, tag)].put(bytes(memoryview(buf).cast("B")))

    def Recv(self, buf, source, tag=0):
        data = self.group.boxes[(source, self.rank, tag)].get(timeout=30)
        memoryview(buf).cast("B")[:len(data)] = data

    def Irecv(self, buf, source, tag=0):
        box = self.group.boxes[(source, self.rank, tag)]

        def poll():
            try:
                data = box.get_nowait()
            except queue.Empty:
                return False, None
            memoryview(buf).cast("B")[:len(data)] = data
            return True, None
        return _Request(poll)

    def Iprobe(self, source, tag=0):
        return not self.group.boxes[(source, self.rank, tag)].empty()

    # collectives
    def allgather(self, obj):
        return self.group.collective(self.rank, obj)

    def gather(self, obj, root=0):
        out = self.group.collective(self.rank, obj)
        return out if self.rank == root else None

    def bcast(self, obj, root=0):
        return self.group.collective(self.rank, obj)[root]

    def Bcast(self, buf, root=0):
        data = self.group.collective(self.rank, np.array(buf, copy=True))[root]
        np.copyto(buf, data)

    def Barrier(self):
        self.group.collective(self.rank, None)

    def Ibarrier(self):
        """Non-blocking, as MPI's: the request completes once every rank has entered."""
        n, self._ibarriers = self._ibarriers, self._ibarriers + 1
        with self.group.lock:
            self.group.ibarriers[n] += 1

        def poll():
            if self.group.aborted():
                raise threading.BrokenBarrierError
            return self.group.ibarriers[n] == self.group.size, None
        return _Request(poll)


class FakeHorovod:
    """horovod.torch's allreduce_/broadcast_/join on the fake world (Sum only)."""

    Sum = "sum"

    class Compression:
        none, fp16 = "none", "fp16"

    def __init__(self, comm: FakeComm):
        self.comm = comm.Dup()
        self.joined = False

    def size(self):
        return self.comm.Get_size()

    def rank(self):
        return self.comm.Get_rank()

    def allreduce_(self, tensor, op=Sum, name=None):
        assert op == self.Sum
        parts = self.comm.allgather(tensor.detach().clone())
        tensor.copy_(torch.stack([p for p in parts if p is not None]).sum(0))
        return tensor

    def broadcast_(self, tensor, root_rank, name=None):
        tensor.copy_(self.comm.bcast(tensor.detach().clone(), root=root_rank))
        return tensor

    def join(self, device=-1):
        """As Horovod's: until every rank has joined, this one adds nothing (None, read as
        zeros) to the others' allreduce_."""
        while any(part is not None for part in self.comm.allgather(None)):
            pass


class FakeWorld:
    def __init__(self, size: int):
        self.group = _Group(size)
        self.size = size

    def run(self, fn, timeout: float = 60.0):
        """fn(comm, hvd) on every rank, each in its thread; their results in rank order.
        An exception on any rank is raised here."""
        results, errors = [None] * self.size, [None] * self.size

        def target(rank):
            comm = FakeComm(self.group, rank)
            try:
                results[rank] = fn(comm, FakeHorovod(comm))
            except BaseException as exc:   # noqa: BLE001 - re-raised below
                errors[rank] = exc
                self.group.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,), daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if any(t.is_alive() for t in threads):
            raise TimeoutError("a rank of the fake world did not finish")
        for exc in errors:
            if exc is not None and not isinstance(exc, threading.BrokenBarrierError):
                raise exc
        for exc in errors:
            if exc is not None:
                raise exc
        return results
