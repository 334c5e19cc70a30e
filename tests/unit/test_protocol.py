"""ashl.protocol: header encode/decode and validation, a decode fuzzer, payload views, the
in-process MPI send/recv path (COMM_SELF) and, marked `mpi`, a real 2-rank exchange."""

import math
import struct
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from ashl import protocol as P
from ashl.protocol import DType, Flag, Header, Kind, ProtocolError
from ashl.stages import Stage

WORLD, NUMEL = 4, 1000


def dense(**kw):
    base = dict(kind=Kind.DENSE_DELTA, rank=1, stage=Stage.AHL, commit=3, base_version=7,
                plan_version=2, epoch=1, local_steps=8, dtype=DType.FLOAT32, numel=NUMEL,
                samples=512, step_s=0.01, link_s=0.002, link_ratio=1.0, loss=0.7)
    base.update(kw)
    return Header(**base)


def sparse(**kw):
    return dense(**{"kind": Kind.SPARSE_DELTA, "stage": Stage.SHL, "nnz": 50, "link_ratio": 0.05, **kw})


def decode(b, **kw):
    return P.decode(b, world_size=kw.pop("world_size", WORLD), model_numel=kw.pop("model_numel", NUMEL), **kw)


def patch(h: Header, **raw) -> bytes:
    """Encode a valid header, then overwrite raw fields (bypassing encode's validation)."""
    fields = list(P._LAYOUT.unpack(P.encode(h)[:P._LAYOUT.size]))
    names = ["magic", "version", "kind", "stage", "flags", "dtype", "reserved", "rank", "plan_version",
             "epoch", "local_steps", "commit", "base_version", "numel", "nnz", "samples", "step_s",
             "link_s", "link_ratio", "loss", "sent_at"]
    for k, v in raw.items():
        fields[names.index(k)] = v
    return P._LAYOUT.pack(*fields) + bytes(P.HEADER_SIZE - P._LAYOUT.size)


# --- round trips ----------------------------------------------------------------------

def test_header_is_128_bytes_and_round_trips():
    for h in (dense(), sparse(), dense(kind=Kind.REPLY, flags=Flag.ACCEPTED | Flag.PLAN_FOLLOWS),
              Header(Kind.REPLY, rank=3), Header(Kind.REPLY, rank=0, stage=Stage.DONE, flags=Flag.STOP),
              Header(Kind.REPLY, rank=2, step_s=0.5, sent_at=12.5),
              Header(Kind.PLAN, rank=0, dtype=DType.UINT8, numel=300)):
        b = P.encode(h)
        assert len(b) == P.HEADER_SIZE == 128
        got = decode(b)
        assert P.encode(got) == b
        assert isinstance(got.kind, Kind) and isinstance(got.stage, Stage) and isinstance(got.dtype, DType)


def test_payload_sizes():
    assert dense().payload_nbytes == 4 * NUMEL
    assert dense(dtype=DType.FLOAT16).payload_nbytes == 2 * NUMEL
    assert sparse().payload_nbytes == 50 * 8
    assert sparse(dtype=DType.BFLOAT16).payload_nbytes == 50 * 6
    assert Header(Kind.REPLY, rank=0).payload_nbytes == 0
    assert dense().nbytes == 128 + 4 * NUMEL
    assert P.max_payload_nbytes(NUMEL) >= 8 * NUMEL


def test_encode_into_buffer_and_nan_means_not_measured():
    out = bytearray(200)
    h = dense(step_s=math.nan, link_s=math.nan, loss=Header.optional(None))
    P.encode(h, out)
    got = decode(bytes(out[:128]))
    assert math.isnan(got.step_s) and math.isnan(got.link_s) and math.isnan(got.loss)
    with pytest.raises(ValueError):
        P.encode(h, bytearray(10))


def test_none_measurements_travel_as_nan_and_errors_pickle():
    got = decode(P.encode(dense(step_s=None, link_s=None, loss=None)))
    assert math.isnan(got.step_s) and math.isnan(got.link_s) and math.isnan(got.loss)
    import pickle
    e = pickle.loads(pickle.dumps(ProtocolError("rank", "bad")))
    assert e.field == "rank" and str(e) == "rank: bad"


def test_stage_wire_codes_round_trip_and_unknown_codes_are_refused():
    assert sorted(s.code for s in Stage) == [0, 1, 2, 3]
    for s in Stage:
        assert Stage.from_code(s.code) is s
        assert decode(P.encode(dense(stage=s))).stage is s
    with pytest.raises(ValueError, match="unknown stage code 7"):
        Stage.from_code(7)


# --- validation names the field ------------------------------------------------------------

@pytest.mark.parametrize("raw,field", [
    (dict(magic=b"XSHL"), "magic"),
    (dict(version=1), "version"),        # the previous wire format
    (dict(kind=0), "kind"), (dict(kind=99), "kind"),
    (dict(stage=4), "stage"),
    (dict(dtype=9), "dtype"),
    (dict(dtype=int(DType.UINT8)), "dtype"),      # a delta must be floating
    (dict(flags=64), "flags"),
    (dict(reserved=1), "reserved"),
    (dict(rank=-1), "rank"), (dict(rank=WORLD), "rank"),
    (dict(commit=-1), "commit"), (dict(base_version=-5), "base_version"),
    (dict(plan_version=-1), "plan_version"), (dict(epoch=-1), "epoch"),
    (dict(local_steps=-1), "local_steps"), (dict(samples=-1), "samples"),
    (dict(numel=-1), "numel"), (dict(numel=NUMEL + 1), "numel"),
    (dict(nnz=3), "nnz"),                          # nnz on a dense delta
    (dict(step_s=math.inf), "step_s"), (dict(step_s=-0.1), "step_s"),
    (dict(link_s=-math.inf), "link_s"),
    (dict(link_ratio=0.0), "link_ratio"), (dict(link_ratio=1.5), "link_ratio"),
    (dict(link_ratio=math.nan), "link_ratio"),
    (dict(loss=math.inf), "loss"),
    (dict(sent_at=math.nan), "sent_at"), (dict(sent_at=-1.0), "sent_at"),
])
def test_decode_rejects_bad_field(raw, field):
    with pytest.raises(ProtocolError) as e:
        decode(patch(dense(), **raw))
    assert e.value.field == field
    assert str(e.value).startswith(field + ":")
    assert isinstance(e.value, ValueError)


def test_sparse_and_payloadless_consistency():
    with pytest.raises(ProtocolError, match="^nnz:"):
        decode(patch(sparse(), nnz=NUMEL + 1))
    decode(patch(sparse(), nnz=NUMEL))   # everything sent: allowed
    decode(patch(sparse(), nnz=0))       # nothing to send: allowed
    with pytest.raises(ProtocolError, match="^dtype:"):
        decode(patch(Header(Kind.PLAN, rank=0, dtype=DType.UINT8, numel=3), dtype=int(DType.FLOAT32)))
    with pytest.raises(ProtocolError, match="^numel:"):
        decode(patch(Header(Kind.REPLY, rank=0), numel=5))
    with pytest.raises(ProtocolError, match="^numel:"):
        decode(patch(Header(Kind.PLAN, rank=0, dtype=DType.UINT8, numel=1), numel=P.MAX_PLAN_BYTES + 1))
    with pytest.raises(ProtocolError, match="^numel:"):   # a model reply must match the model
        decode(P.encode(dense(kind=Kind.REPLY, numel=NUMEL - 1)))


@pytest.mark.parametrize("data,nbytes", [(b"", None), (b"ASHL", None), (bytes(127), None),
                                         (bytes(129), None), (bytes(256), 127)])
def test_decode_rejects_wrong_length(data, nbytes):
    with pytest.raises(ProtocolError) as e:
        decode(data, nbytes=nbytes)
    assert e.value.field == "length"


def test_decode_uses_nbytes_prefix_of_larger_buffer():
    buf = bytearray(4096)
    buf[:128] = P.encode(dense())
    assert decode(buf, nbytes=128).commit == 3


def test_encode_validates_before_anything_is_sent():
    with pytest.raises(ProtocolError, match="^link_ratio:"):
        P.encode(dense(link_ratio=2.0))
    with pytest.raises(ProtocolError, match="^rank:"):
        P.encode(dense(rank=-2))
    with pytest.raises(ProtocolError, match="^kind:"):
        P.encode(dense(kind=42))
    with pytest.raises(ProtocolError, match="^commit:"):
        P.encode(dense(commit=1.5))


# --- fuzzing -----------------------------------------------------------------------------

def _decodes_or_protocol_error(b: bytes, world: int, numel: int):
    try:
        h = P.decode(b, world_size=world, model_numel=numel)
    except ProtocolError:
        return None
    # Anything accepted is a fully valid header that re-encodes to a decodable header.
    assert 0 <= h.rank < world
    assert h.payload_nbytes >= 0 and h.nnz <= max(h.numel, 0)
    P.validate(h, world_size=world, model_numel=numel)
    again = P.decode(P.encode(h), world_size=world, model_numel=numel)
    assert again.kind == h.kind and again.numel == h.numel and again.nnz == h.nnz
    return h


@given(st.binary(min_size=0, max_size=300), st.integers(1, 64), st.integers(0, 10**7))
def test_fuzz_random_bytes(b, world, numel):
    _decodes_or_protocol_error(b, world, numel)


@given(st.binary(min_size=128, max_size=128))
def test_fuzz_random_bytes_with_valid_magic(b):
    b = P.MAGIC + struct.pack("<H", P.VERSION) + b[6:]
    _decodes_or_protocol_error(b, WORLD, NUMEL)


valid_headers = st.sampled_from([dense(), sparse(), Header(Kind.REPLY, rank=2),
                                 dense(kind=Kind.REPLY, flags=Flag.ACCEPTED),
                                 Header(Kind.PLAN, rank=0, dtype=DType.UINT8, numel=77)])


@given(valid_headers, st.lists(st.tuples(st.integers(0, 127), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_mutated_valid_headers(h, edits):
    b = bytearray(P.encode(h))
    for pos, val in edits:
        b[pos] = val
    _decodes_or_protocol_error(bytes(b), WORLD, NUMEL)


@given(valid_headers, st.integers(0, 127))
def test_fuzz_truncated_valid_headers(h, cut):
    with pytest.raises(ProtocolError) as e:
        P.decode(P.encode(h)[:cut], world_size=WORLD, model_numel=NUMEL)
    assert e.value.field == "length"


field_values = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                         st.none(), st.text(max_size=3), st.booleans())


@given(st.sampled_from(["kind", "rank", "stage", "commit", "base_version", "plan_version", "epoch",
                        "local_steps", "dtype", "numel", "nnz", "flags", "samples", "step_s",
                        "link_s", "link_ratio", "loss", "sent_at"]), field_values)
def test_fuzz_validate_any_field_value(name, value):
    """Any value in any field: validate either accepts it and it encodes, or names an error."""
    h = dense().replace(**{name: value})
    try:
        P.encode(h)
    except ProtocolError:
        pass
    except (TypeError, struct.error, OverflowError) as e:  # pragma: no cover - the bug we guard
        pytest.fail(f"{name}={value!r} raised {type(e).__name__}: {e}")


# --- payload views ---------------------------------------------------------------------

def test_dense_and_sparse_views_share_memory():
    buf = torch.zeros(8 * 10, dtype=torch.uint8)
    h = sparse(numel=NUMEL, nnz=10)
    idx, val = P.sparse_views(h, buf)
    idx.copy_(torch.arange(10, dtype=torch.int32) * 3)
    val.fill_(2.5)
    idx2, val2 = P.sparse_views(h, buf)
    assert idx2.tolist() == list(range(0, 30, 3)) and val2.tolist() == [2.5] * 10
    d = dense(numel=20)
    buf = torch.zeros(80, dtype=torch.uint8)
    P.dense_view(d, buf).fill_(1.0)
    assert buf.view(torch.float32).sum() == 20
    with pytest.raises(ValueError):
        P.dense_view(h, buf)
    with pytest.raises(ValueError):
        P.sparse_views(d, buf)


def test_json_payload_round_trip():
    obj = {"plan_version": 3, "shares": ["1/3", "2/3"]}
    raw = P.json_payload(obj)
    h = Header(Kind.PLAN, rank=0, dtype=DType.UINT8, numel=raw.size)
    assert P.Message(h, torch.from_numpy(raw.copy()), 0).json() == obj
    bad = P.Message(h.replace(numel=2), torch.tensor([0xFF, 0xFE], dtype=torch.uint8), 0)
    with pytest.raises(ProtocolError, match="^payload:"):
        bad.json()


# --- MPI in-process (COMM_SELF) ----------------------------------------------------------------

@pytest.fixture(scope="module")
def MPI():
    pytest.importorskip("mpi4py")
    from mpi4py import MPI
    return MPI


def in_thread(fn, *args, **kw):
    """Run a blocking send beside the receive (a send to self waits for its receive)."""
    t = threading.Thread(target=fn, args=args, kwargs=kw, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(30)
def test_send_recv_self_dense_and_sparse(MPI):
    comm = MPI.COMM_SELF
    buf = P.MessageBuffer(P.max_payload_nbytes(NUMEL))
    delta = torch.randn(NUMEL)
    h = dense(rank=0, numel=NUMEL)
    t = in_thread(P.send, comm, 0, h, delta)
    m = P.recv(comm, buf, tag=P.TAG_TO_SERVER, model_numel=NUMEL)
    assert m.source == 0 and m.header.commit == 3 and torch.equal(m.dense(), delta)
    assert m.dense().data_ptr() == buf.tensor.data_ptr() + P.HEADER_SIZE  # landed in place

    idx = torch.tensor([1, 5, 999], dtype=torch.int32)
    val = torch.tensor([0.5, -1.0, 2.0])
    wire = torch.cat([idx.view(torch.uint8), val.view(torch.uint8)])
    t.join(10)
    P.send(comm, 0, sparse(rank=0, nnz=3), wire, tag=P.TAG_TO_RANK)  # small: sent eagerly
    m = P.recv(comm, buf, source=0, tag=P.TAG_TO_RANK, model_numel=NUMEL)
    i, v = m.sparse()
    assert torch.equal(i, idx) and torch.equal(v, val)

    P.send(comm, 0, Header(Kind.REPLY, rank=0))
    m = P.recv(comm, buf, model_numel=NUMEL)
    assert m.header.kind == Kind.REPLY and m.payload.numel() == 0


@pytest.mark.timeout(30)
def test_send_checks_payload_size(MPI):
    with pytest.raises(ValueError, match="payload has"):
        P.send(MPI.COMM_SELF, 0, dense(rank=0), torch.zeros(NUMEL - 1))
    with pytest.raises(ValueError, match="needs a"):
        P.send(MPI.COMM_SELF, 0, dense(rank=0), None)
    with pytest.raises(ValueError, match="no payload"):
        P.send(MPI.COMM_SELF, 0, Header(Kind.REPLY, rank=0), torch.zeros(3))
    with pytest.raises(ValueError, match="contiguous"):
        P.send(MPI.COMM_SELF, 0, dense(rank=0, numel=10), torch.zeros(10, 2)[:, 0])


@pytest.mark.timeout(30)
def test_a_packed_message_is_a_copy_that_arrives_as_sent(MPI):
    comm = MPI.COMM_SELF
    buf = P.MessageBuffer(P.max_payload_nbytes(NUMEL))
    delta = torch.randn(NUMEL)
    expected = delta.clone()
    message = P.packed(dense(rank=0, numel=NUMEL), delta)
    delta.fill_(0.0)                      # changed before the send: the copy is sent
    request = P.isend(comm, 0, message, tag=P.TAG_TO_RANK)
    m = P.recv(comm, buf, source=0, tag=P.TAG_TO_RANK, model_numel=NUMEL)
    request.Wait()
    assert m.header.commit == 3 and torch.equal(m.dense(), expected)
    request = P.isend(comm, 0, P.packed(Header(Kind.REPLY, rank=0)), tag=P.TAG_TO_RANK)
    m = P.recv(comm, buf, source=0, tag=P.TAG_TO_RANK, model_numel=NUMEL)
    request.Wait()
    assert m.header.kind == Kind.REPLY and m.payload.numel() == 0


def test_packed_checks_the_payload_as_send_does():
    with pytest.raises(ValueError, match="payload has"):
        P.packed(dense(rank=0), torch.zeros(NUMEL - 1))
    with pytest.raises(ValueError, match="needs a"):
        P.packed(dense(rank=0), None)
    with pytest.raises(ValueError, match="no payload"):
        P.packed(Header(Kind.REPLY, rank=0), torch.zeros(3))
    with pytest.raises(ValueError, match="contiguous"):
        P.packed(dense(rank=0, numel=10), torch.zeros(10, 2)[:, 0])
    with pytest.raises(ValueError, match="out must be"):
        P.packed(dense(rank=0, numel=10), torch.zeros(10),
                 out=np.empty(P.HEADER_SIZE + 39, dtype=np.uint8))


@pytest.mark.timeout(30)
def test_recv_checks_byte_count_and_drains_oversized(MPI):
    comm = MPI.COMM_SELF
    buf = P.MessageBuffer(4 * NUMEL)
    # A header announcing NUMEL floats followed by only 10: the count check catches it.
    short = np.concatenate([np.frombuffer(P.encode(dense(rank=0)), np.uint8), np.zeros(40, np.uint8)])
    t = in_thread(comm.Send, [short, MPI.BYTE], 0, P.TAG_TO_SERVER)
    with pytest.raises(ProtocolError) as e:
        P.recv(comm, buf, model_numel=NUMEL)
    assert e.value.field == "length" and "announces" in str(e.value)
    # Larger than the buffer: consumed and reported; the next message still arrives intact.
    t.join(10)
    big = np.zeros(P.HEADER_SIZE + 4 * NUMEL + 8, np.uint8)
    t = in_thread(lambda: (comm.Send([big, MPI.BYTE], 0, P.TAG_TO_SERVER),
                           P.send(comm, 0, Header(Kind.REPLY, rank=0, flags=Flag.STOP))))
    with pytest.raises(ProtocolError, match="exceeds"):
        P.recv(comm, buf, model_numel=NUMEL)
    assert P.recv(comm, buf, model_numel=NUMEL).header.flags == Flag.STOP
    t.join(10)
    # Shorter than a header.
    comm.Send([np.zeros(10, np.uint8), MPI.BYTE], 0, P.TAG_TO_SERVER)
    with pytest.raises(ProtocolError, match="shorter than a header"):
        P.recv(comm, buf, model_numel=NUMEL)
    # Garbage of header size: the header's own validation.
    comm.Send([np.zeros(P.HEADER_SIZE, np.uint8), MPI.BYTE], 0, P.TAG_TO_SERVER)
    with pytest.raises(ProtocolError, match="^magic:"):
        P.recv(comm, buf, model_numel=NUMEL)
