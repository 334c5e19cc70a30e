"""Between a model's device and the wire: the buffers a commit is packed into, and the
copies that take them to and from the host memory that MPI and ZeroMQ read.

A CPU model needs none of it: the kernels write the wire buffer itself, and a reply's model
is unpacked from the receive buffer where it landed. A CUDA model is packed, top-k selected
and unpacked on its device; only bytes cross to the host:

    commit   fused pack (delta, residual, scale) -> device flat buffer -> [top-k on the device]
             -> one asynchronous copy, on a side stream, into a pinned host buffer
             -> the send (MPI or ZeroMQ) reads the host buffer
    reply    pinned host receive buffer -> one copy to a device buffer -> one fused unpack

The side stream waits for the compute stream (the pack's kernels) and the send waits for the
side stream: that is a commit's one synchronisation. The copy to the device is queued on the
compute stream, so the unpack and the next forward pass follow it in stream order with no
wait on the host. Neither transport is given device memory: Debian's Open MPI is not
CUDA-aware, and ashl does not use CUDA-aware MPI where one is (docs/DESIGN.md).

The host receive buffer is safe to reuse: the next message into it is the answer to a later
commit, whose ``to_host`` waited for every copy queued before it. The host send buffer is
too: a rank packs its next commit only once the previous one's reply is in, and the server
replies once it holds the whole commit. Buffers grow geometrically (``GROWTH``), so the
top-k payloads' varying sizes stop reallocating pinned memory after a few commits.

The decisions (staged or not, which buffer, how big, which stream waits on which) are one
code path for every device: ``WireStaging("cpu", staged=True)`` runs them with plain host
buffers, which is how they are tested on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch

from .compression import Payload

__all__ = ["WireStaging", "STAGE_ENV"]

# Stage a CPU model's commits too (through separate host buffers): the CUDA path's code,
# run where there is no GPU (tests; a user has no reason to set it).
STAGE_ENV = "ASHL_STAGE_WIRE"

# An outgrown buffer's successor is this much larger (at least what is asked): payloads of
# varying size (top-k's) settle after O(log) allocations, none in the steady state.
GROWTH = 1.5


class WireStaging:
    """The device buffers of one rank's commits and their trips to and from host memory.

    `staged` (default: the device is not the CPU, or ASHL_STAGE_WIRE=1) says whether
    payloads cross to host buffers; pinned host memory when the device is CUDA."""

    def __init__(self, device, staged: Optional[bool] = None):
        self.device = torch.device(device)
        if staged is None:
            staged = self.device.type != "cpu" or os.environ.get(STAGE_ENV) == "1"
        self.staged = bool(staged)
        self.pinned = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.pinned else None
        self._buffers: dict[tuple[str, bool], torch.Tensor] = {}
        self.allocations = 0
        self.copies = {"to_host": 0, "to_device": 0, "bytes_to_host": 0, "bytes_to_device": 0}

    def __repr__(self) -> str:
        return f"WireStaging({self.device}, staged={self.staged})"

    # ------------------------------------------------------------------------- buffers
    def device_buffer(self, name: str, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` on the model's device, kept for the next call
        of the same name (grown by GROWTH at least, never shrunk). A buffer replaced by a
        larger one is dropped, not freed under its users: the views handed out keep its
        memory, and pinned memory returns to torch's host allocator only once the copies
        queued on it are done."""
        return self._buffer(name, nbytes, host=False)

    def host_buffer(self, name: str, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of at least `nbytes` (pinned when the device is CUDA)."""
        return self._buffer(name, nbytes, host=True)

    def _buffer(self, name: str, nbytes: int, host: bool) -> torch.Tensor:
        key = (name, host)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            size = nbytes if buf is None else max(nbytes, math.ceil(buf.numel() * GROWTH))
            if host:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
            else:
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._buffers[key] = buf
            self.allocations += 1
        return buf

    def flat(self, name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
        """A flat `dtype` view of `numel` elements of the device buffer `name`."""
        nbytes = numel * dtype.itemsize
        return self.device_buffer(name, nbytes)[:nbytes].view(dtype)

    # -------------------------------------------------------------------------- copies
    def to_host(self, payload: Payload) -> Payload:
        """`payload` with its bytes in the host send buffer, ready for the wire (itself when
        nothing is staged)."""
        if not self.staged:
            return payload
        host = self.host_buffer("send", payload.nbytes)[:payload.nbytes]
        self.copy_to_host(host, payload.buffer)
        return Payload(payload.kind, payload.dtype, payload.numel, payload.nnz, host)

    def copy_to_host(self, host: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """host <- src, finished when this returns: on the side stream, after the work
        already queued on the compute stream (what wrote `src`)."""
        with self._side_stream():
            host.copy_(src, non_blocking=self.pinned)
        if self.stream is not None:
            self.stream.synchronize()   # the send reads `host` next
        self.copies["to_host"] += 1
        self.copies["bytes_to_host"] += src.numel() * src.element_size()
        return host

    def to_device(self, flat: torch.Tensor, name: str = "model") -> torch.Tensor:
        """`flat` (a host tensor: a reply's model) on the model's device: itself when it is
        there already, else copied into the device buffer `name`, queued on the compute
        stream ahead of the kernels that read it."""
        if flat.device == self.device and not self.staged:
            return flat
        return self.from_host(self.flat(name, flat.numel(), flat.dtype), flat)

    def from_host(self, dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """dst (on the device) <- host, queued on the compute stream (nothing when `host`
        is `dst`: nothing was staged)."""
        if host is not dst:
            dst.copy_(host, non_blocking=self.pinned and host.is_pinned())
            self.copies["to_device"] += 1
            self.copies["bytes_to_device"] += host.numel() * host.element_size()
        return dst

    def to_host_flat(self, flat: torch.Tensor, name: str = "flat") -> torch.Tensor:
        """`flat` (device) copied into the host buffer `name`, as a tensor of its dtype:
        for a collective that reads host memory (Horovod without GPU operations, MPI)."""
        if not self.staged:
            return flat
        nbytes = flat.numel() * flat.element_size()
        host = self.host_buffer(name, nbytes)[:nbytes].view(flat.dtype)
        return self.copy_to_host(host, flat)

    @contextlib.contextmanager
    def _side_stream(self):
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
