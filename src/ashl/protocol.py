"""Wire format of the messages between a rank and the parameter server.

Every message is ONE MPI message: a fixed 128-byte header followed by the payload bytes.
One message per commit keeps a commit atomic (nothing is left in flight when a header is
bad, and two threads receiving on one communicator cannot split a header from its payload)
and costs one latency instead of two. The sender does not copy: `send` gathers the header
and the caller's payload tensor with an MPI struct datatype. The receiver lands both in one
preallocated `MessageBuffer`; the payload starts 128 bytes in, so typed views of it are
aligned and can feed the merge/unpack kernels directly.

Header (little-endian, see `_LAYOUT`): magic, version, kind, stage, flags, dtype, rank (the
SENDER), plan version, epoch, local steps, commit number, base version (the global model
version a delta was computed against, or the version a reply carries), numel (elements the
payload describes: the model size for deltas and model replies), nnz (pairs in a sparse
payload), samples, and the rank's measurements (step_s, link_s, link_ratio, loss) so the
coordinator gets its reports with each commit, and the send time (sent_at, the host-wide monotonic clock) from which an emulated slow link
delivers the message.

Payload layouts:
  DENSE_DELTA, REPLY  numel values of `dtype`
  SPARSE_DELTA        nnz int32 indices (ascending), then nnz values of `dtype`
  PLAN, SUMMARY, JOIN numel bytes of UTF-8 JSON (dtype UINT8), never pickled
A REPLY may also carry nothing (dtype NONE), e.g. the answer to a commit after DONE. Its
local_steps field carries a time-based strategy's commit-rate target (adsp's c_target; 0:
none), so the scheduler's decisions need no channel of their own; its epoch field the epoch
from which the data shares of the run's current plan and stage apply (the same on every rank).
The stage byte is ``ashl.stages.Stage.code``.

Optional float measurements use NaN for "not measured" (CommitReport's None); infinities
and negative durations are always rejected.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch

from .stages import Stage

__all__ = [
    "MAGIC", "VERSION", "HEADER_SIZE", "MAX_MESSAGE_BYTES", "MAX_PLAN_BYTES", "ProtocolError",
    "Kind", "DType", "Flag", "Header", "encode", "decode", "validate",
    "MessageBuffer", "Message", "send", "packed", "isend", "recv", "received", "dense_view",
    "sparse_views", "max_payload_nbytes", "json_payload", "TAG_TO_SERVER", "TAG_TO_RANK",
]

MAGIC = b"ASHL"
VERSION = 3                # 3: SUMMARY, DROPPED; 2: no wait_s field, Stage codes from ashl.stages
HEADER_SIZE = 128          # a multiple of 64: payload views after it stay aligned
MAX_MESSAGE_BYTES = 2**31 - 1   # MPI counts are C ints; one message carries at most this
MAX_PLAN_BYTES = 1 << 20   # a plan is a few KiB of JSON; anything near this is garbage

# Default tags: commits travel to the server on one, answers back on the other, so a rank
# that hosts the server thread never receives its own commits as replies.
TAG_TO_SERVER = 0x5A1
TAG_TO_RANK = 0x5A2

_LAYOUT = struct.Struct(
    "<4s"   # magic
    "H"     # version
    "B"     # kind
    "B"     # stage
    "H"     # flags
    "B"     # dtype
    "B"     # reserved (0)
    "i"     # rank (sender)
    "i"     # plan_version
    "i"     # epoch
    "i"     # local_steps
    "q"     # commit
    "q"     # base_version
    "q"     # numel
    "q"     # nnz
    "q"     # samples
    "d"     # step_s
    "d"     # link_s
    "d"     # link_ratio
    "d"     # loss
    "d"     # sent_at
)
_PAD = HEADER_SIZE - _LAYOUT.size
assert _PAD >= 0


class ProtocolError(ValueError):
    """A message that does not follow the protocol; `field` names the offending part."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self):  # picklable, e.g. across a process pool
        return type(self), (self.field, self.message)


class Kind(enum.IntEnum):
    DENSE_DELTA = 1    # rank -> server: a full delta
    SPARSE_DELTA = 2   # rank -> server: top-k indices + values
    REPLY = 4          # server -> rank: directive (+ the global model)
    PLAN = 7           # server -> rank: a new plan as JSON bytes
    SUMMARY = 8        # server -> rank, fault-tolerant end: the run's end (reason, lost ranks) as JSON
                       # (and the answer to a JOIN: the slot the replacement takes)
    JOIN = 9           # a replacement -> server: asks for a lost rank's slot (its profile as JSON)
    HELLO = 10         # rank -> server, ZeroMQ: "this connection is rank r" (no payload)


class DType(enum.IntEnum):
    NONE = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    UINT8 = 4

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def torch_dtype(self) -> torch.dtype:
        if self is DType.NONE:
            raise ValueError("DType.NONE has no torch dtype")
        return _TORCH[self]

    @classmethod
    def of(cls, dtype: torch.dtype) -> "DType":
        for code, t in _TORCH.items():
            if t == dtype:
                return code
        raise ValueError(f"no wire dtype for {dtype}")


_ITEMSIZE = {DType.NONE: 0, DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.UINT8: 1}
_TORCH = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16,
          DType.BFLOAT16: torch.bfloat16, DType.UINT8: torch.uint8}
_FLOAT_CODES = (DType.FLOAT32, DType.FLOAT16, DType.BFLOAT16)
INDEX_ITEMSIZE = 4  # int32 indices: a flat model of up to 2^31 - 1 elements


class Flag(enum.IntFlag):
    ACCEPTED = 1      # REPLY: the delta was merged (not rejected as non-finite / late)
    STOP = 2          # REPLY: the run is over for this rank
    PLAN_FOLLOWS = 4  # REPLY: a PLAN message follows on the same tag
    FINAL = 8         # delta: this rank's last commit
    DROPPED = 16      # REPLY: the server had dropped this rank as lost (fault-tolerant mode)


_ALL_FLAGS = int(Flag.ACCEPTED | Flag.STOP | Flag.PLAN_FOLLOWS | Flag.FINAL | Flag.DROPPED)
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class Header:
    kind: Kind
    rank: int
    stage: Stage = Stage.PROFILE
    commit: int = 0
    base_version: int = 0
    plan_version: int = 0
    epoch: int = 0
    local_steps: int = 0
    dtype: DType = DType.NONE
    numel: int = 0
    nnz: int = 0
    flags: Flag = Flag(0)
    samples: int = 0
    step_s: float = math.nan
    link_s: float = math.nan
    link_ratio: float = 1.0
    loss: float = math.nan
    sent_at: float = 0.0   # sender's host-wide monotonic clock; emulated links deliver from it

    @property
    def payload_nbytes(self) -> int:
        """Bytes of payload after the header."""
        if self.kind == Kind.SPARSE_DELTA:
            return self.nnz * (INDEX_ITEMSIZE + DType(self.dtype).itemsize)
        return self.numel * DType(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole message."""
        return HEADER_SIZE + self.payload_nbytes

    def replace(self, **changes) -> "Header":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def optional(x: float | None) -> float:
        """None -> NaN, the wire's "not measured"."""
        return math.nan if x is None else float(x)


def max_payload_nbytes(model_numel: int) -> int:
    """The largest payload a message about a model of this size can have (sparse at nnz=numel)."""
    return max(model_numel * (INDEX_ITEMSIZE + 4), MAX_PLAN_BYTES)


# --- validation -------------------------------------------------------------------

def _int_in(h: Header, name: str, lo: int, hi: int) -> None:
    v = getattr(h, name)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ProtocolError(name, f"must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(name, f"{v} is outside [{lo}, {hi}]")


def _real(h: Header, name: str) -> float:
    v = getattr(h, name)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ProtocolError(name, f"must be a number, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:
        raise ProtocolError(name, f"{v} does not fit a double") from None


def _duration(h: Header, name: str, optional: bool) -> None:
    v = _real(h, name)
    if math.isnan(v) and optional:
        return
    if not math.isfinite(v) or v < 0:
        raise ProtocolError(name, f"must be a finite number >= 0{' or NaN' if optional else ''}, got {v}")


def validate(h: Header, world_size: int | None = None, model_numel: int | None = None) -> Header:
    """Check every field; `world_size`/`model_numel` enable the checks that need them.

    Returns the header with its enum fields as enums. Raises ProtocolError naming the field.
    """
    kind, stage, dtype = _enums(h)
    hi_rank = _INT32[1] if world_size is None else world_size - 1
    _int_in(h, "rank", 0, hi_rank)
    for name in ("plan_version", "epoch", "local_steps"):
        _int_in(h, name, 0, _INT32[1])
    for name in ("commit", "base_version", "numel", "nnz", "samples"):
        _int_in(h, name, 0, _INT64[1])
    h = _measurements(h)
    _payload_shape(h, kind, dtype, model_numel)
    if h.nbytes > MAX_MESSAGE_BYTES:
        raise ProtocolError("numel", f"a {h.nbytes}-byte message exceeds the MPI limit {MAX_MESSAGE_BYTES}")
    return h.replace(kind=kind, stage=stage, dtype=dtype, flags=Flag(int(h.flags)),
                     **{k: float(getattr(h, k)) for k in ("step_s", "link_s", "link_ratio", "loss", "sent_at")},
                     **{k: int(getattr(h, k)) for k in ("rank", "plan_version", "epoch", "local_steps",
                                                        "commit", "base_version", "numel", "nnz", "samples")})


def _enums(h: Header) -> tuple[Kind, Stage, DType]:
    try:
        kind = Kind(h.kind)
    except (ValueError, TypeError):
        raise ProtocolError("kind", f"unknown message kind {h.kind!r}") from None
    try:
        stage = h.stage if isinstance(h.stage, Stage) else Stage.from_code(h.stage)
    except (ValueError, TypeError):
        raise ProtocolError("stage", f"unknown stage code {h.stage!r}") from None
    try:
        dtype = DType(h.dtype)
    except (ValueError, TypeError):
        raise ProtocolError("dtype", f"unknown payload dtype code {h.dtype!r}") from None
    if isinstance(h.flags, bool) or not isinstance(h.flags, (int, np.integer)) or h.flags & ~_ALL_FLAGS or h.flags < 0:
        raise ProtocolError("flags", f"unknown flag bits in {h.flags!r}")
    return kind, stage, dtype


def _measurements(h: Header) -> Header:
    """The rank's measurements; None is accepted for the optional ones and travels as NaN."""
    h = h.replace(**{k: math.nan for k in ("step_s", "link_s", "loss") if getattr(h, k) is None})
    for name in ("step_s", "link_s"):
        _duration(h, name, optional=True)
    _duration(h, "sent_at", optional=False)
    ratio = _real(h, "link_ratio")
    if not math.isfinite(ratio) or not 0.0 < ratio <= 1.0:
        raise ProtocolError("link_ratio", f"must be in (0, 1], got {ratio}")
    if math.isinf(_real(h, "loss")):
        raise ProtocolError("loss", f"must be finite or NaN (not measured), got {h.loss}")
    return h


def _payload_shape(h: Header, kind: Kind, dtype: DType, model_numel: int | None) -> None:
    """What each kind of message may carry."""
    if kind in (Kind.DENSE_DELTA, Kind.SPARSE_DELTA) or (kind == Kind.REPLY and dtype != DType.NONE):
        if dtype not in _FLOAT_CODES:
            raise ProtocolError("dtype", f"{kind.name} needs a floating payload, got {dtype.name}")
        if model_numel is not None and h.numel != model_numel:
            raise ProtocolError("numel", f"{kind.name} describes {h.numel} elements but the model has {model_numel}")
        if kind == Kind.SPARSE_DELTA:
            if h.nnz > h.numel:
                raise ProtocolError("nnz", f"{h.nnz} pairs for a model of {h.numel} elements")
            if h.numel > _INT32[1] + 1:
                raise ProtocolError("numel", f"{h.numel} elements cannot be addressed by int32 indices")
        elif h.nnz != 0:
            raise ProtocolError("nnz", f"must be 0 for {kind.name}, got {h.nnz}")
    elif kind in (Kind.PLAN, Kind.SUMMARY, Kind.JOIN):
        if dtype != DType.UINT8:
            raise ProtocolError("dtype", f"{kind.name} carries UINT8 JSON bytes, got {dtype.name}")
        if h.numel > MAX_PLAN_BYTES:
            raise ProtocolError("numel", f"a {kind.name} of {h.numel} bytes exceeds {MAX_PLAN_BYTES}")
        if h.nnz != 0:
            raise ProtocolError("nnz", f"must be 0 for {kind.name}, got {h.nnz}")
    else:  # a REPLY without a model, a HELLO
        if dtype != DType.NONE:
            raise ProtocolError("dtype", f"{kind.name} carries no payload, got {dtype.name}")
        if h.numel != 0 or h.nnz != 0:
            raise ProtocolError("numel" if h.numel else "nnz", f"must be 0 for {kind.name} without payload")


# --- encode / decode ------------------------------------------------------------------

def encode(h: Header, out=None) -> bytes | None:
    """The 128 header bytes (validated first). With `out` (a writable buffer), writes into it."""
    h = validate(h)
    fields = (MAGIC, VERSION, int(h.kind), h.stage.code, int(h.flags), int(h.dtype), 0,
              h.rank, h.plan_version, h.epoch, h.local_steps, h.commit, h.base_version, h.numel,
              h.nnz, h.samples, float(h.step_s), float(h.link_s), float(h.link_ratio),
              float(h.loss), float(h.sent_at))
    if out is None:
        return _LAYOUT.pack(*fields) + bytes(_PAD)
    mv = memoryview(out).cast("B")
    if len(mv) < HEADER_SIZE:
        raise ValueError(f"out has {len(mv)} bytes, a header needs {HEADER_SIZE}")
    _LAYOUT.pack_into(mv, 0, *fields)
    mv[_LAYOUT.size:HEADER_SIZE] = bytes(_PAD)
    return None


def decode(data, nbytes: int | None = None, *, world_size: int, model_numel: int) -> Header:
    """Parse and validate a header.

    `data` is any bytes-like object; `nbytes` is how many of its bytes are the header as
    received (default: all of them), which must be exactly HEADER_SIZE. `world_size` bounds
    the rank; `model_numel` is the flat model size deltas and replies must describe.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    mv = memoryview(data).cast("B")
    n = len(mv) if nbytes is None else nbytes
    if n != HEADER_SIZE or len(mv) < HEADER_SIZE:
        got = min(n, len(mv))
        raise ProtocolError("length", f"a header is {HEADER_SIZE} bytes, got {got}"
                            + (" (truncated)" if got < HEADER_SIZE else ""))
    (magic, version, kind, stage, flags, dtype, reserved, rank, plan_version, epoch, local_steps,
     commit, base_version, numel, nnz, samples, step_s, link_s, link_ratio, loss,
     sent_at) = _LAYOUT.unpack_from(mv, 0)
    if magic != MAGIC:
        raise ProtocolError("magic", f"expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError("version", f"this build speaks version {VERSION}, got {version}")
    if reserved != 0 or any(mv[_LAYOUT.size:HEADER_SIZE]):
        raise ProtocolError("reserved", "reserved bytes must be zero")
    h = Header(kind=kind, rank=rank, stage=stage, commit=commit, base_version=base_version,
               plan_version=plan_version, epoch=epoch, local_steps=local_steps, dtype=dtype,
               numel=numel, nnz=nnz, flags=flags, samples=samples, step_s=step_s, link_s=link_s,
               link_ratio=link_ratio, loss=loss, sent_at=sent_at)
    return validate(h, world_size=world_size, model_numel=model_numel)


# --- payload views ------------------------------------------------------------------

def dense_view(h: Header, payload: torch.Tensor) -> torch.Tensor:
    """The dense payload of a DENSE_DELTA / REPLY as a 1-D tensor of its dtype (no copy)."""
    if h.kind not in (Kind.DENSE_DELTA, Kind.REPLY) or h.dtype not in _FLOAT_CODES:
        raise ValueError(f"{Kind(h.kind).name} with dtype {DType(h.dtype).name} has no dense payload")
    return payload[:h.payload_nbytes].view(DType(h.dtype).torch_dtype)


def sparse_views(h: Header, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 indices, values) of a SPARSE_DELTA payload (no copy)."""
    if h.kind != Kind.SPARSE_DELTA:
        raise ValueError(f"{Kind(h.kind).name} has no sparse payload")
    split = h.nnz * INDEX_ITEMSIZE
    indices = payload[:split].view(torch.int32)
    values = payload[split:h.payload_nbytes].view(DType(h.dtype).torch_dtype)
    return indices, values


def _as_bytes(payload) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor / array (no copy)."""
    if isinstance(payload, torch.Tensor):
        if payload.device.type != "cpu":
            raise ValueError(f"payload must be on the CPU, got {payload.device}")
        if not payload.is_contiguous():
            raise ValueError("payload must be contiguous")
        return payload.reshape(-1).view(torch.uint8).numpy()
    arr = np.asarray(payload)
    if not arr.flags.c_contiguous:
        raise ValueError("payload must be C-contiguous")
    return arr.reshape(-1).view(np.uint8)


# --- MPI point-to-point --------------------------------------------------------------

class MessageBuffer:
    """A preallocated receive buffer: header + up to `payload_capacity` payload bytes.

    Allocate once per peer/thread with `MessageBuffer(protocol.max_payload_nbytes(numel))`
    (or less, e.g. 4 * numel when sparse payloads never exceed dense ones). `pinned`: in
    page-locked memory, for one asynchronous copy on to a GPU (staging.py).
    """

    def __init__(self, payload_capacity: int, pinned: bool = False):
        if payload_capacity < 0:
            raise ValueError(f"payload_capacity must be >= 0, got {payload_capacity}")
        self.tensor = torch.empty(HEADER_SIZE + payload_capacity, dtype=torch.uint8,
                                  pin_memory=pinned)
        self.array = self.tensor.numpy()

    @property
    def capacity(self) -> int:
        return self.tensor.numel() - HEADER_SIZE


class Message(NamedTuple):
    header: Header
    payload: torch.Tensor   # uint8 view into the MessageBuffer, exactly payload_nbytes long
    source: int

    def dense(self) -> torch.Tensor:
        return dense_view(self.header, self.payload)

    def sparse(self) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_views(self.header, self.payload)

    def json(self):
        """The object a PLAN, SUMMARY or JOIN message carries."""
        if self.header.kind not in (Kind.PLAN, Kind.SUMMARY, Kind.JOIN):
            raise ValueError(f"{Kind(self.header.kind).name} carries no JSON")
        try:
            return json.loads(bytes(self.payload.numpy()).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProtocolError("payload", f"{self.header.kind.name} is not UTF-8 JSON: {e}") from None


def json_payload(obj) -> np.ndarray:
    """UTF-8 JSON bytes of `obj` as a uint8 array, for a PLAN message (numel = its size)."""
    return np.frombuffer(json.dumps(obj, separators=(",", ":")).encode("utf-8"), dtype=np.uint8)


def _mpi():
    from mpi4py import MPI  # imported lazily: importing mpi4py.MPI initialises MPI
    return MPI


def _body(header: Header, payload) -> Optional[np.ndarray]:
    """The payload's bytes (no copy), checked against the header; None when it has none."""
    want = header.payload_nbytes
    if want == 0:
        if payload is not None and _as_bytes(payload).size != 0:
            raise ValueError(f"{Kind(header.kind).name} carries no payload but one was given")
        return None
    if payload is None:
        raise ValueError(f"{Kind(header.kind).name} needs a {want}-byte payload")
    body = _as_bytes(payload)
    if body.size != want:
        raise ValueError(f"payload has {body.size} bytes but the header says {want}")
    return body


def send(comm, dest: int, header: Header, payload=None, tag: int = TAG_TO_SERVER, *,
         wait: Optional[Callable[[Any], bool]] = None) -> bool:
    """Send header + payload as one message, without copying the payload; True once sent.

    `payload`: a contiguous CPU tensor / numpy array whose bytes are the payload (for a
    sparse delta: int32 indices immediately followed by the values, e.g. a
    compression.Payload's `buffer`). Its byte size must match the header.

    `wait`: the message goes with MPI_Isend and `wait(request)` says whether it completed.
    A send it gives up on (False, or an error it raises) is left pending, and its buffers
    are kept for the process's lifetime, since MPI may yet read them.
    """
    MPI = _mpi()
    head = np.frombuffer(encode(header), dtype=np.uint8)
    body = _body(header, payload)
    datatype = None
    if body is None:
        message = [head, MPI.BYTE]
    else:   # one message from two buffers: a struct datatype over absolute addresses
        datatype = MPI.Datatype.Create_struct(
            [HEADER_SIZE, body.size], [MPI.Get_address(head), MPI.Get_address(body)],
            [MPI.BYTE, MPI.BYTE]).Commit()
        message = [MPI.BOTTOM, 1, datatype]
    try:
        if wait is None:
            comm.Send(message, dest, tag)
            return True
        request, done = comm.Isend(message, dest, tag), False
        try:
            done = bool(wait(request))
        finally:
            if not done:
                keep_pending(request, head, body)
        return done
    finally:
        if datatype is not None:
            datatype.Free()   # MPI frees it once a pending send is done with it


_PENDING: list = []   # (request, buffers...) that MPI may still use: see keep_pending


def keep_pending(request, *buffers) -> None:
    """Keep `buffers` for the process's lifetime: `request` (a send given up, a reply not yet
    read when its end closed) has not completed, and MPI may yet use them."""
    _PENDING.append((request, *buffers))


def packed(header: Header, payload=None, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Header + payload copied into one array (`out`, a uint8 array of the message's size,
    or a new one): a message to send later (``isend``), whatever becomes of the payload
    meanwhile."""
    body = _body(header, payload)
    if out is None:
        out = np.empty(header.nbytes, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.shape != (header.nbytes,):
        raise ValueError(f"out must be a uint8 array of {header.nbytes} bytes, got "
                         f"{out.dtype} {out.shape}")
    out[:HEADER_SIZE] = np.frombuffer(encode(header), dtype=np.uint8)
    if body is not None:
        out[HEADER_SIZE:] = body
    return out


def isend(comm, dest: int, message: np.ndarray, tag: int = TAG_TO_RANK):
    """Start sending a ``packed`` message; the request, which must complete before
    `message` is dropped."""
    return comm.Isend([message, _mpi().BYTE], dest, tag)


def recv(comm, buffer: MessageBuffer, *, source: int | None = None, tag: int = TAG_TO_SERVER,
         model_numel: int, check_source: bool = True) -> Message:
    """Receive one message into `buffer`; validate header and byte count.

    Uses a matched probe, so several threads may receive on one communicator. A message that
    does not fit is still consumed (then ProtocolError), so the stream stays in step. With
    `check_source`, the header's rank must be the MPI source.
    """
    MPI = _mpi()
    status = MPI.Status()
    msg = comm.Mprobe(MPI.ANY_SOURCE if source is None else source, tag, status)
    count = status.Get_count(MPI.BYTE)
    src = status.Get_source()
    if count > buffer.tensor.numel():
        msg.Recv([np.empty(count, dtype=np.uint8), MPI.BYTE])  # drain it, then complain
        raise ProtocolError("length", f"a {count}-byte message from rank {src} exceeds the "
                            f"{buffer.tensor.numel()}-byte buffer")
    msg.Recv([buffer.array, MPI.BYTE], status)
    return received(buffer, status.Get_count(MPI.BYTE), src, world_size=comm.Get_size(),
                    model_numel=model_numel, check_source=check_source)


def received(buffer: MessageBuffer, count: int, src: int, *, world_size: int, model_numel: int,
             check_source: bool = True) -> Message:
    """The message whose `count` bytes have landed in `buffer` from rank `src` (any
    transport), validated: its header, its byte count, and with `check_source` its sender."""
    if count < HEADER_SIZE:
        raise ProtocolError("length", f"a {count}-byte message from rank {src} is shorter than a header")
    header = decode(buffer.array[:HEADER_SIZE], world_size=world_size, model_numel=model_numel)
    if count != header.nbytes:
        raise ProtocolError("length", f"received {count} bytes from rank {src} but the header "
                            f"announces {header.nbytes} ({header.payload_nbytes} payload)")
    if check_source and header.rank != src:
        raise ProtocolError("rank", f"header says rank {header.rank} but the sender is rank {src}")
    return Message(header, buffer.tensor[HEADER_SIZE:HEADER_SIZE + header.payload_nbytes], src)
