"""Print what one rank sees, as one JSON line: Horovod's and MPI's rank, size, local rank.

    mpirun -np 2 python tests/cluster/rank_info.py [OUT_DIR]

With OUT_DIR each rank also writes OUT_DIR/rank<MPI rank>.json. Used by the launch tests under
mpirun, horovodrun and srun --mpi=pmix.
"""
import json
import os
import socket
import sys

from mpi4py import MPI
import horovod.torch as hvd

hvd.init(comm=MPI.COMM_WORLD)
world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED)
info = {
    "hvd": {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(), "mpi_enabled": hvd.mpi_enabled(),
            "mpi_threads_supported": hvd.mpi_threads_supported()},
    "mpi": {"rank": world.Get_rank(), "size": world.Get_size(), "local_rank": node.Get_rank(),
            "local_size": node.Get_size(), "processor": MPI.Get_processor_name()},
    "host": socket.gethostname(),
    "env": {k: v for k, v in os.environ.items()
            if k.startswith(("OMPI_COMM_WORLD_", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
                             "SLURM_NODEID", "SLURM_JOB_ID", "PMIX_RANK", "HOROVOD_"))},
}
# the sums prove every rank is in one world and Horovod's collectives reach all of them
import torch  # noqa: E402
info["allreduce_sum"] = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
info["mpi_allreduce_sum"] = world.allreduce(world.Get_rank())
print(json.dumps(info), flush=True)
if len(sys.argv) > 1:
    with open(os.path.join(sys.argv[1], f"rank{world.Get_rank()}.json"), "w") as f:
        json.dump(info, f)
hvd.shutdown()
