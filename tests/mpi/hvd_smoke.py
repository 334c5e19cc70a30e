"""Two ranks: Horovod and mpi4py on one Open MPI, and ashl's pack/unpack around hvd.allreduce_."""
import json
import sys

from mpi4py import MPI
import horovod.torch as hvd
import torch

from ashl import kernels

hvd.init(comm=MPI.COMM_WORLD)
rank, size = hvd.rank(), hvd.size()
assert MPI.COMM_WORLD.Get_rank() == rank and MPI.COMM_WORLD.Get_size() == size


def initial_params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen),
            torch.randn(2, 2, 2, generator=gen)]


params = initial_params(rank)
anchors = [torch.zeros_like(p) for p in params]
flat = torch.empty(kernels.flat_numel(params))
kernels.pack_delta(params, anchors, flat, scale=1.0 / size)  # this rank's share of the mean
hvd.allreduce_(flat, op=hvd.Sum, name="delta")
kernels.unpack_add(params, anchors, flat)  # params = anchors = 0 + mean of all ranks

flat_of = lambda ps: torch.cat([p.flatten() for p in ps])
expected = sum(flat_of(initial_params(r)) for r in range(size)) / size
ok = torch.allclose(flat_of(params), expected, atol=1e-6) and torch.equal(flat_of(params),
                                                                          flat_of(anchors))
gathered = MPI.COMM_WORLD.gather(bool(ok), root=0)
if rank == 0:
    json.dump({"size": size, "all_ok": all(gathered), "thread_level": MPI.Query_thread()},
              open(sys.argv[1], "w"))
