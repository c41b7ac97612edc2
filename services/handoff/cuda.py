"""CUDA_IPC: the GPU feature arena, one device allocation exported once over CUDA IPC.

The vision process allocates `n_pages * page_bytes` on its GPU at start-up and exports
the allocation's IPC handle once (PyTorch's storage-sharing tuple: the raw
cudaIpcMemHandle_t, the storage's size and offset inside the allocation, and PyTorch's
ref-counter and event handles). Runs of pages are leased exactly like host ones; the lease
table lives in the arena's shared-memory header (services/handoff/arena.py).

Readiness, chosen by the producer (`--ready-signal`):
- `sync`: the producer synchronises its stream after writing, before it replies;
- `event`: the producer records the interprocess CUDA event of the run's first page after writing
  and the consumer's stream waits on it. A page's event is made and exported the first time a run
  starts there, not all at start-up (a few thousand pages for 7B presets), and opened once.

The consumer opens each arena's allocation once per process (opening, and PyTorch's first
rebuild above all, is costly) and reads runs in place: `open` returns a view
of the producer's memory, ordered after the producer's write on the consumer's stream, with
no copy and no host synchronisation. The consumer must hold the lease until its kernels
have read the view (the llm engine: until the prefill that copies the features into the
prompt's embeddings has run, then it re-checks the lease and releases it).

On another GPU of the same host (`CUDA_IPC_PEER`, `vlmesh up --placement split`), the consumer
opens the same allocation on the producer's GPU (peer access: NVLink or PCIe) and copies the run
into its own GPU on its stream, still with no host synchronisation; kernels cannot read another
GPU's memory in place through PyTorch, and the copy (4.7 MB in about 21 us over NVLink,
2026-11-30) is small beside the prefill that reads it.

Both sides work on the device's current stream, cached once: a hand-off is a handful of
Python calls, and `torch.cuda.current_stream(device)` alone is a sizeable share of that.

Importing this module touches no CUDA API: a CPU host imports it, and a CPU consumer's
transport refuses CUDA_IPC references (no GPU). CUDA is initialised only when an arena or
a consumer's imports are made for a CUDA device.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from services.common.config import READY_SIGNALS
from services.common.errors import FailedPrecondition
from services.handoff.arena import ArenaTable, ArenaView, ArenaViews
from services.handoff.header import CUDA
from services.handoff.leases import Lease
from services.handoff.transport import ArenaTransport
from services.handoff.wire import Layout, Origin
from vlmesh.v1 import common_pb2 as pb

VIEW_CACHE = 4096  # typed views a consumer keeps (a few hundred bytes each)


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID: equal on both sides exactly when they use the same physical GPU."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else f"{props.name}/{props.pci_bus_id}"  # type: ignore[attr-defined]


def _bytes(value: object) -> bytes:
    return b"" if value is None else bytes(value)


class CudaArena(ArenaTable):
    """A GPU arena: `n_pages` pages of `page_bytes` in one device allocation, its IPC handle made once."""

    def __init__(
        self, page_bytes: int, n_pages: int, ttl_s: float, device: torch.device, ready: str, keep_limit: int = 0
    ) -> None:
        super().__init__(page_bytes, n_pages, ttl_s, CUDA, keep_limit)
        if ready not in READY_SIGNALS:
            raise ValueError(f"ready signal {ready!r}: use one of {READY_SIGNALS}")
        self.device = device
        self.ready = ready
        self.gpu_uuid = gpu_uuid(device)
        self.stream = torch.cuda.current_stream(device)
        # One allocation for the arena's whole life; exported once.
        self.buffer = torch.empty(n_pages * self.page_bytes, dtype=torch.uint8, device=device)
        shared = self.buffer.untyped_storage()._share_cuda_()
        _dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = shared
        self.ipc = pb.CudaIpcHandle(
            mem_handle=_bytes(handle),
            storage_bytes=size,
            storage_offset=offset,
            ref_counter_handle=_bytes(rc_handle),
            ref_counter_offset=rc_offset,
            event_handle=_bytes(ev_handle),
            event_sync_required=bool(ev_sync),
        )
        self._events: dict[int, tuple[torch.cuda.Event, bytes]] = {}  # first page of a run: event, handle

    def ready_event(self, page: int) -> tuple[torch.cuda.Event, bytes]:
        """The interprocess event of runs that start at `page`, and its IPC handle, made on first use."""
        made = self._events.get(page)
        if made is None:
            with torch.cuda.device(self.device):
                event = torch.cuda.Event(interprocess=True)
                event.record(self.stream)  # an event must be recorded once before it has an IPC handle
                made = self._events[page] = (event, bytes(event.ipc_handle()))
        return made

    def write(self, tensor: torch.Tensor) -> tuple[Lease, int]:
        """Enqueue a device-to-device copy into a fresh run of pages; `finish` makes it readable."""
        nbytes = tensor.numel() * tensor.element_size()
        lease = self.acquire(nbytes)
        offset = self.page_offset(lease.page)
        self.buffer[offset : offset + nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8), non_blocking=True)
        return lease, offset

    def tensor(self, offset: int, layout: Layout) -> torch.Tensor:
        """The producer's own view of a written run (no copy)."""
        return self.buffer[offset : offset + layout.nbytes].view(layout.dtype).view(layout.shape)

    def finish(self, leases: list[Lease]) -> None:
        """Signal readiness of written runs and publish their leases."""
        if self.ready == "sync":
            self.stream.synchronize()
        else:
            for lease in leases:
                self.ready_event(lease.page)[0].record(self.stream)
        for lease in leases:
            self.publish(lease)

    def close(self) -> None:
        """Unlink the header and drop the allocation (consumers' mappings keep it alive until they go)."""
        super().close()
        self.buffer = None  # type: ignore[assignment]


class CudaImports:
    """Consumer side: opened arena allocations, typed views and events, cached for the process's life."""

    def __init__(self, device: torch.device) -> None:
        torch.cuda.init()  # opening IPC handles needs an initialised CUDA context
        self.device = device
        self.stream = torch.cuda.current_stream(device)
        self._buffers: dict[str, torch.Tensor] = {}
        self._index_of: dict[str, int] | None = None  # GPU UUID -> this process's CUDA index
        self._events: dict[tuple[str, int], torch.cuda.Event] = {}
        # (arena, offset, nbytes, dtype, shape) -> typed view, least recently used first: pictures of
        # any size make offsets x shapes without end, so the most recent VIEW_CACHE stay.
        self._views: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def device_of(self, uuid: str) -> torch.device:
        """The GPU with this UUID as this process numbers it; FAILED_PRECONDITION when it sees none."""
        if self._index_of is None:
            self._index_of = {gpu_uuid(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}
        index = self._index_of.get(uuid)
        if index is None:
            raise FailedPrecondition(f"tensor reference on GPU {uuid!r}, which this process does not see")
        return torch.device("cuda", index)

    def _buffer(self, name: str, ipc: pb.CudaIpcHandle, home: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            if not ipc.mem_handle:
                raise FailedPrecondition("CUDA_IPC tensor reference carries no memory handle")
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    home.index or 0,
                    ipc.mem_handle,
                    ipc.storage_bytes,
                    ipc.storage_offset,
                    ipc.ref_counter_handle or None,
                    ipc.ref_counter_offset,
                    ipc.event_handle or None,
                    ipc.event_sync_required,
                )
            except RuntimeError as err:
                raise FailedPrecondition(f"cannot open the CUDA IPC handle of arena {name!r}: {err}") from err
            buf = torch.empty(0, dtype=torch.uint8, device=home).set_(storage)
            self._buffers[name] = buf
        return buf

    def open(
        self, view: ArenaView, ref: pb.TensorRef, dtype: torch.dtype, shape: tuple[int, ...], home: torch.device
    ) -> torch.Tensor:
        """A view of a GPU run on `home` (the producer's GPU), readable by work enqueued after this
        on the consumer's stream (a copy to another GPU included: PyTorch orders it after the
        destination's stream).

        No copy, no host sync: valid while the caller holds the lease (see the module's doc).
        """
        if view.location != CUDA:
            raise FailedPrecondition(f"arena {view.name!r} is not a CUDA arena")
        pages = view.pages(ref.offset, ref.nbytes)
        view.check(pages, ref.lease.id)
        key = (view.name, ref.offset, ref.nbytes, dtype, shape)
        out = self._views.get(key)
        if out is None:
            buf = self._buffer(view.name, ref.cuda_ipc, home)
            if ref.offset + ref.nbytes > buf.numel():
                raise FailedPrecondition(f"tensor reference out of bounds of arena {view.name!r}")
            out = self._views[key] = buf[ref.offset : ref.offset + ref.nbytes].view(dtype).view(shape)
            if len(self._views) > VIEW_CACHE:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(key)
        if ref.ready == pb.READY_SIGNAL_CUDA_EVENT:
            event = self._events.get((view.name, pages[0]))
            if event is None:
                event = torch.cuda.Event.from_ipc_handle(home, ref.ready_event)
                self._events[(view.name, pages[0])] = event
            self.stream.wait_event(event)
        return out

    def forget(self, name: str) -> None:
        """Drop an arena whose producer is gone."""
        self._buffers.pop(name, None)
        for cache in (self._events, self._views):
            for key in [k for k in cache if k[0] == name]:
                del cache[key]

    def close(self) -> None:
        """Drop every opened arena."""
        for name in list(self._buffers):
            self.forget(name)


class CudaIpcTransport(ArenaTransport):
    """TRANSPORT_CUDA_IPC: leased pages of a GPU arena, read in place by a consumer on the same GPU.

    The consumer must hold the lease until its kernels have read the tensor, then `verify`.
    """

    kind = pb.TRANSPORT_CUDA_IPC
    label = "cuda"
    in_place = True
    arena: CudaArena | None

    def __init__(
        self,
        *,
        arena: CudaArena | None = None,
        origin: Origin | None = None,
        views: ArenaViews | None = None,
        imports: CudaImports | None = None,
        gpu_uuid: str = "",
    ) -> None:
        super().__init__(arena=arena, origin=origin, views=views)
        self.imports = imports  # consumer side; None on a CPU consumer, which refuses CUDA_IPC
        self.gpu_uuid = gpu_uuid

    @classmethod
    def producer(
        cls, host: str, page_bytes: int, n_pages: int, ttl_s: float, device: torch.device, ready: str, keep: int = 0
    ) -> CudaIpcTransport:
        """The producer's end: owns a fresh arena on `device` (its origin carries the GPU's UUID).

        `keep` of its pages may be kept under content keys (see leases.py)."""
        arena = CudaArena(page_bytes, n_pages, ttl_s, device, ready, keep)
        return cls(arena=arena, origin=Origin(host, arena.gpu_uuid), gpu_uuid=arena.gpu_uuid)

    @classmethod
    def consumer(cls, views: ArenaViews, device: torch.device) -> CudaIpcTransport:
        """The consumer's end: opens arenas onto `device`; on a CPU device it refuses every reference."""
        if device.type != "cuda":
            return cls(views=views)
        imports = CudaImports(device)
        return cls(views=views, imports=imports, gpu_uuid=gpu_uuid(device))

    @property
    def accepted(self) -> bool:
        return self.imports is not None

    def _write(self, tensor: torch.Tensor) -> tuple[Lease, int]:
        arena = self._producer_arena()
        assert isinstance(arena, CudaArena)
        return arena.write(tensor)

    def run_tensor(self, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        arena = self._producer_arena()
        assert isinstance(arena, CudaArena)
        return arena.tensor(ref.offset, layout)

    def _finish(self, leases: list[Lease]) -> None:
        arena = self._producer_arena()
        assert isinstance(arena, CudaArena)
        arena.finish(leases)

    def _ref(self, lease: Lease, offset: int, tensor: torch.Tensor) -> pb.TensorRef:
        ref = super()._ref(lease, offset, tensor)
        arena = self._producer_arena()
        assert isinstance(arena, CudaArena)
        ref.cuda_ipc.CopyFrom(arena.ipc)
        if arena.ready == "event":
            ref.ready = pb.READY_SIGNAL_CUDA_EVENT
            ref.ready_event = arena.ready_event(lease.page)[1]
        return ref

    def _read(self, view: ArenaView, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        if self.imports is None:
            raise FailedPrecondition(f"this process has no GPU: it cannot open {self.name} references")
        return self.imports.open(view, ref, layout.dtype, tuple(layout.shape), self.imports.device)

    def _forget(self, name: str) -> None:
        super()._forget(name)
        if self.imports is not None:
            self.imports.forget(name)

    def close(self) -> None:
        super().close()
        if self.imports is not None:
            self.imports.close()


def peer_gpu_uuids(device: torch.device) -> list[str]:
    """The other GPUs of this process whose memory `device` reads directly (peer access)."""
    if device.type != "cuda":
        return []
    here = device.index if device.index is not None else torch.cuda.current_device()
    return [
        gpu_uuid(torch.device("cuda", i))
        for i in range(torch.cuda.device_count())
        if i != here and torch.cuda.can_device_access_peer(here, i)
    ]


class CudaIpcPeerTransport(CudaIpcTransport):
    """TRANSPORT_CUDA_IPC_PEER: a GPU arena read from another GPU of the same host, copied over the
    peer link into the consumer's GPU (see the module's doc).

    The producer's end exports into its CUDA_IPC transport's own arena (one arena, two ways to
    read it). The consumer holds the lease until its reader has read the copy (`in_place`, as for
    CUDA_IPC): the copy runs on the GPU after `open` returns.
    """

    kind = pb.TRANSPORT_CUDA_IPC_PEER
    label = "cuda-peer"
    in_place = True
    peers: tuple[str, ...] = ()  # consumer side: the GPUs it reads over the peer link

    @classmethod
    def sharing(cls, same_gpu: CudaIpcTransport) -> CudaIpcPeerTransport:
        """The producer's end: exports into `same_gpu`'s arena."""
        return cls(arena=same_gpu.arena, origin=same_gpu.origin, gpu_uuid=same_gpu.gpu_uuid)

    @classmethod
    def beside(cls, same_gpu: CudaIpcTransport) -> CudaIpcPeerTransport:
        """The consumer's end, sharing `same_gpu`'s views and opened allocations."""
        peer = cls(views=same_gpu.views, imports=same_gpu.imports, gpu_uuid=same_gpu.gpu_uuid)
        peer.peers = tuple(peer_gpu_uuids(same_gpu.imports.device)) if same_gpu.imports is not None else ()
        return peer

    @property
    def accepted(self) -> bool:
        return self.imports is not None and bool(self.peers)

    def _read(self, view: ArenaView, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        if self.imports is None:
            raise FailedPrecondition(f"this process has no GPU: it cannot open {self.name} references")
        home = self.imports.device_of(ref.gpu_uuid)
        src = self.imports.open(view, ref, layout.dtype, tuple(layout.shape), home)
        return src.to(self.imports.device, non_blocking=True)

    def close(self) -> None:
        """The arena and the opened allocations belong to the CUDA_IPC transport it shares them with."""
