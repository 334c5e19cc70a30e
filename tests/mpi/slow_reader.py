"""MPIServerEnd under mpirun -np 3: rank 1 reads its reply only once rank 2 says it has its
own, although the server replied to rank 1 first. A blocking MPI_Send of the 4 MB reply to
rank 1 would hold the server until rank 1 reads, so rank 2 would never have its reply and
rank 1 would give up waiting for its word. Each reply must also carry the model as it was
when sent (the server changes it right after)."""
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

from ashl import protocol as P
from ashl.stages import Stage
from ashl.transport import MPIRankEnd, MPIServerEnd

NUMEL, WORD, PATIENCE_S = 1 << 20, 7302, 30.0
comm = MPI.COMM_WORLD.Dup()
rank = comm.Get_rank()
assert comm.Get_size() == 3, "run with mpirun -np 3"


def abort(*exc_info):
    traceback.print_exception(*exc_info)
    MPI.COMM_WORLD.Abort(1)       # the other ranks would wait for this one for ever


sys.excepthook = abort


def reply(version: int) -> P.Header:
    return P.Header(kind=P.Kind.REPLY, rank=0, stage=Stage.AHL, base_version=version,
                    flags=P.Flag.ACCEPTED, dtype=P.DType.FLOAT32, numel=NUMEL)


def received_word() -> bool:
    deadline = time.monotonic() + PATIENCE_S
    while not comm.Iprobe(source=2, tag=WORD):
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-3)
    comm.recv(source=2, tag=WORD)
    return True


if rank == 0:
    end = MPIServerEnd(comm, NUMEL)
    model = np.zeros(NUMEL, dtype=np.float32)
    for dest in (1, 2):
        model[:] = dest
        end.send(dest, reply(dest), model)
    model[:] = -1                                   # the merges after the replies
    end.send(1, reply(3), model, until_written=True)   # returns once rank 1 has it
    end.close()
else:
    end = MPIRankEnd(comm, 0, NUMEL)
    buffer = P.MessageBuffer(4 * NUMEL)
    if rank == 1:
        heard = received_word()
        first = end.recv(buffer)
        assert (first.header.base_version, float(first.dense().min()),
                float(first.dense().max())) == (1, 1.0, 1.0)
        last = end.recv(buffer)
        assert last.header.base_version == 3 and float(last.dense().max()) == -1.0
        if not heard:
            heard = received_word()
            print(f"rank 1 FAIL: rank 2 had no reply while rank 1 did not read its own "
                  f"(rank 2's word {'came after' if heard else 'never came'})", flush=True)
            MPI.COMM_WORLD.Abort(1)
    else:
        own = end.recv(buffer)
        assert own.header.base_version == 2 and float(own.dense().min()) == 2.0
        comm.send("mine is here", dest=1, tag=WORD)
comm.Barrier()
print(f"rank {rank} OK", flush=True)
comm.Free()
