"""Coverage-guided fuzzing of what a peer rank can send: the header decoder and the
bounds-checked sparse merge. Anything but a clean ProtocolError/IndexError/False is a bug.

    python tests/soak/fuzz_atheris.py -runs=200000      # or -max_total_time=600
"""
import struct
import sys

import atheris

import torch  # not instrumented: only ashl's own code is the target

with atheris.instrument_imports():
    from ashl import kernels, protocol

N = 1000


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    kind = fdp.ConsumeIntInRange(0, 2)
    if kind == 0:   # a header as received
        raw = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200))
        try:
            protocol.decode(raw, world_size=fdp.ConsumeIntInRange(1, 64), model_numel=N)
        except protocol.ProtocolError:
            pass
    elif kind == 1:   # a valid header with mutated bytes
        h = protocol.Header(kind=protocol.Kind.DENSE_DELTA, rank=1, dtype=protocol.DType.FLOAT32,
                            numel=N, step_s=0.01, loss=0.5)
        raw = bytearray(protocol.encode(h))
        for _ in range(fdp.ConsumeIntInRange(1, 8)):
            raw[fdp.ConsumeIntInRange(0, len(raw) - 1)] = fdp.ConsumeIntInRange(0, 255)
        try:
            protocol.decode(bytes(raw), world_size=4, model_numel=N)
        except protocol.ProtocolError:
            pass
    else:   # a sparse payload: indices and values straight from the wire
        nnz = fdp.ConsumeIntInRange(0, 64)
        idx = torch.tensor([fdp.ConsumeIntInRange(-2**31, 2**31 - 1) for _ in range(nnz)],
                           dtype=torch.int32)
        vals = torch.tensor(struct.unpack(f"<{nnz}f", fdp.ConsumeBytes(4 * nnz).ljust(4 * nnz, b"\0")),
                            dtype=torch.float32)
        dst = torch.zeros(N)
        try:
            ok = kernels.merge_sparse(dst, idx, vals, 0.5)
        except IndexError:
            assert torch.equal(dst, torch.zeros(N)), "an out-of-range index wrote something"
            return
        if not ok:
            assert torch.equal(dst, torch.zeros(N)), "a non-finite value wrote something"


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
