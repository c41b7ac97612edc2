"""The consumer role (the llm process): turns TensorRefs into tensors and hands their leases back.

`Consumer.open` resolves a request's references through one transport object per kind
(arenas attached once per process) and returns an `Opened`: the tensors, and which of
them are the producer's memory read in place (CUDA IPC) rather than copies (SHM, INLINE).
A copy's lease may go at once; an in-place tensor's lease is held until its reader has
read it, then verified and released (`Opened.hold`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence

import torch

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.hostinfo import host_id
from services.common.metrics import HANDOFF_BYTES, HANDOFFS
from services.handoff.arena import ArenaViews
from services.handoff.cuda import CudaIpcPeerTransport, CudaIpcTransport
from services.handoff.inline import InlineTransport
from services.handoff.release import release_leases
from services.handoff.shm import ShmTransport
from services.handoff.transport import Transport
from services.handoff.wire import layout, transport_name
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import vision_pb2_grpc


class HeldLeases:
    """The leases of tensors read in place, handed to their reader (the llm engine) until it has read them.

    `verify` and `release` may be called from the reader's own thread; the release RPC is
    sent from the event loop the leases were taken on.
    """

    def __init__(self, opened: Opened, loop: asyncio.AbstractEventLoop) -> None:
        self._opened = opened
        self._loop = loop
        self._lock = threading.Lock()
        self._released = False

    @property
    def refs(self) -> list[pb.TensorRef]:
        """The references whose leases are held."""
        return self._opened.in_place

    def verify(self) -> None:
        """FAILED_PRECONDITION unless every lease still holds: call it before and after reading."""
        self._opened.verify()

    def release(self) -> None:
        """Hand the leases back (once; later calls do nothing), without waiting; any thread."""
        with self._lock:
            if self._released:
                return
            self._released = True
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): the TTL reclaims them
            self._loop.call_soon_threadsafe(self._opened.consumer.release_soon, self.refs)


class Opened:
    """The tensors of one request's references, and the leases behind them."""

    def __init__(
        self,
        consumer: Consumer,
        refs: Sequence[pb.TensorRef],
        tensors: list[torch.Tensor],
        in_place: dict[int, Transport],
    ) -> None:
        self.refs = list(refs)
        self.tensors = tensors  # one per reference, each of its shape (the llm's: [image_tokens, H])
        self.consumer = consumer
        self._in_place = in_place  # index in refs -> the transport that opened it in place
        self._handed = False  # the in-place leases went to their reader (`hold`)

    @property
    def in_place(self) -> list[pb.TensorRef]:
        """The references whose tensors are the producer's memory: valid only while their leases hold."""
        return [self.refs[i] for i in self._in_place]

    def verify(self) -> None:
        """FAILED_PRECONDITION unless every in-place tensor's lease still holds (so its pages were not reused)."""
        for i, transport in self._in_place.items():
            transport.verify(self.refs[i])

    def hold(self) -> HeldLeases | None:
        """Hand the in-place tensors' leases to their reader; None when every tensor is a copy.

        Call it on the event loop. The reader verifies before and after reading, then releases;
        `release_rest` leaves these leases to it.
        """
        if not self._in_place:
            return None
        self._handed = True
        return HeldLeases(self, asyncio.get_running_loop())

    def release_rest(self) -> None:
        """Hand back, without waiting, every lease not handed to a reader by `hold`.

        Call it once the tensors are copied where they are needed: copies were made on open,
        and a reader that copies everything (nothing held) has copied the in-place ones too.
        """
        held = self._in_place if self._handed else {}
        self.consumer.release_soon([ref for i, ref in enumerate(self.refs) if i not in held])


class Consumer:
    """Opens feature references; knows what this process accepts and whom to hand leases back to."""

    def __init__(
        self,
        device: torch.device | None = None,
        vision: vision_pb2_grpc.VisionStub | None = None,
        release_timeout_s: float = 5.0,
    ) -> None:
        """Opens onto `device` (CUDA IPC only on a GPU); releases leases to `vision` (None: the TTL does)."""
        self.device = device or torch.device("cpu")
        self.host = host_id()
        self._vision = vision
        self._release_timeout_s = release_timeout_s
        self._views = ArenaViews()  # one attachment per arena, shared by the arena transports
        cuda = CudaIpcTransport.consumer(self._views, self.device)  # CUDA initialised only on a GPU
        self.gpu_uuid = cuda.gpu_uuid  # "" on a CPU
        peer = CudaIpcPeerTransport.beside(cuda)
        self.peer_gpu_uuids = list(peer.peers)  # the GPUs it reads over the peer link
        # Best first. On a CPU the CUDA transports are kept, not accepted: they refuse CUDA references.
        self._transports: list[Transport] = [cuda, peer, ShmTransport.consumer(self._views), InlineTransport()]
        self._by_kind = {t.kind: t for t in self._transports}
        self._counters: dict[int, tuple] = {}  # per transport: (hand-offs, bytes) metric children
        self._background: set[asyncio.Task] = set()

    @property
    def transports(self) -> list[int]:
        """What this process can open, best first (its Info's transports, the producer's `accept`)."""
        return [t.kind for t in self._transports if t.accepted]

    def _open_one(self, ref: pb.TensorRef) -> tuple[torch.Tensor, Transport]:
        want = layout(ref)
        transport = self._by_kind.get(ref.transport)
        if transport is None:
            raise FailedPrecondition(f"transport {transport_name(ref.transport)} is not available in this process")
        out = transport.open(ref, want)
        count, size = self._counters.get(ref.transport) or self._counters.setdefault(
            ref.transport, (HANDOFFS.labels(transport.name), HANDOFF_BYTES.labels(transport.name))
        )
        count.inc()
        size.inc(want.nbytes)
        return out, transport

    def open(
        self, refs: Sequence[pb.TensorRef], shape: tuple[int, ...] | None = None, field: str = "features"
    ) -> Opened:
        """The tensors `refs` name, in order; with `shape`, INVALID_ARGUMENT for one of another shape.

        FAILED_PRECONDITION for a stale, forged or malformed reference, UNAVAILABLE when its
        producer is gone. On an error nothing is released: the caller releases `refs`.
        """
        tensors: list[torch.Tensor] = []
        in_place: dict[int, Transport] = {}
        for i, ref in enumerate(refs):
            tensor, transport = self._open_one(ref)
            if shape is not None and tuple(tensor.shape) != tuple(shape):
                raise InvalidArgument(f"{field}[{i}] has shape {tuple(tensor.shape)}; this model needs {tuple(shape)}")
            tensors.append(tensor)
            if transport.in_place:
                in_place[i] = transport
        return Opened(self, refs, tensors, in_place)

    async def release(self, refs: Sequence[pb.TensorRef]) -> None:
        """Hand the leases back and wait; the producer's TTL covers a release that gets lost."""
        await release_leases(self._vision, refs, self._release_timeout_s)

    def release_soon(self, refs: Sequence[pb.TensorRef]) -> None:
        """Hand the leases back without waiting (the happy path). Call it on the event loop."""
        if not refs:
            return
        task = asyncio.create_task(self.release(refs))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def close(self) -> None:
        """Detach from every arena and drop what was opened."""
        for t in self._transports:
            t.close()
        self._views.close()
