"""Two ranks: rank 1 commits a dense and a top-k delta to rank 0, rank 0 merges them and
replies with the global model and a plan. Run by tests/mpi/test_protocol_mpi.py under mpirun -np 2."""
import sys

import torch
from mpi4py import MPI

from ashl import protocol as P
from ashl.compression import Compression, Payload, Residual
from ashl.stages import Stage

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
assert comm.Get_size() == 2, "run with mpirun -np 2"
SERVER, WORKER, NUMEL, WEIGHT = 0, 1, 4096, 0.5


def deltas():
    g = torch.Generator().manual_seed(7)
    return torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)


def expected_global():
    d1, d2 = deltas()
    sent2 = Compression.topk(0.05).compress(d2.clone()).to_dense()
    return WEIGHT * d1 + WEIGHT * sent2


if rank == SERVER:
    glob = torch.zeros(NUMEL)
    buf = P.MessageBuffer(P.max_payload_nbytes(NUMEL))
    kinds = []
    for commit in (1, 2):
        m = P.recv(comm, buf, tag=P.TAG_TO_SERVER, model_numel=NUMEL)
        assert m.source == WORKER and m.header.rank == WORKER and m.header.commit == commit
        assert m.header.step_s == 0.01 * commit and m.header.samples == 64 * commit
        kinds.append(m.header.kind)
        assert Payload.from_message(m.header, m.payload).merge_into(glob, WEIGHT)
    assert kinds == [P.Kind.DENSE_DELTA, P.Kind.SPARSE_DELTA], kinds
    assert torch.allclose(glob, expected_global(), atol=1e-6)
    reply = P.Header(P.Kind.REPLY, rank=SERVER, stage=Stage.SHL, commit=2, base_version=2,
                     dtype=P.DType.FLOAT32, numel=NUMEL, flags=P.Flag.ACCEPTED | P.Flag.PLAN_FOLLOWS,
                     sent_at=0.001)
    P.send(comm, WORKER, reply, glob, tag=P.TAG_TO_RANK)
    plan = P.json_payload({"plan_version": 2, "shares": ["1/3", "2/3"]})
    P.send(comm, WORKER, P.Header(P.Kind.PLAN, rank=SERVER, dtype=P.DType.UINT8, numel=plan.size),
           plan, tag=P.TAG_TO_RANK)
else:
    d1, d2 = deltas()
    params = [torch.zeros(NUMEL)]
    residual = Residual(params)
    for commit, (delta, comp) in enumerate(((d1, Compression.none), (d2, Compression.topk(0.05))), 1):
        payload = comp.compress(delta, residual)
        header = P.Header(rank=WORKER, stage=Stage.AHL if commit == 1 else Stage.SHL,
                          commit=commit, step_s=0.01 * commit, samples=64 * commit,
                          link_ratio=comp.ratio, **payload.header_fields())
        P.send(comm, SERVER, header, payload.buffer, tag=P.TAG_TO_SERVER)
    assert residual.flat.count_nonzero() == NUMEL - 205  # k = ceil(0.05 * 4096)
    buf = P.MessageBuffer(4 * NUMEL)
    m = P.recv(comm, buf, source=SERVER, tag=P.TAG_TO_RANK, model_numel=NUMEL)
    assert m.header.kind == P.Kind.REPLY and m.header.flags & P.Flag.PLAN_FOLLOWS
    assert m.header.stage is Stage.SHL and m.header.sent_at == 0.001
    assert torch.allclose(m.dense(), expected_global(), atol=1e-6)
    plan = P.recv(comm, buf, source=SERVER, tag=P.TAG_TO_RANK, model_numel=NUMEL)
    assert plan.json() == {"plan_version": 2, "shares": ["1/3", "2/3"]}

print(f"rank {rank} OK", flush=True)
sys.stdout.flush()
