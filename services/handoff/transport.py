"""The interface every transport (CUDA_IPC, SHM, INLINE) implements, and the base of the two arena ones.

A transport object holds both ends of one kind of hand-off. A process makes it for one
role: the producer's (`export`, `release`, `reap`: it owns the arena and writes its pages) or
the consumer's (`open`, `verify`: it reads references). The Producer and Consumer roles
(producer.py, consumer.py) hold one object per kind and never branch on the kind.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar, Protocol

import torch

from services.common.errors import FailedPrecondition, Unavailable
from services.handoff.arena import ArenaTable, ArenaView, ArenaViews
from services.handoff.leases import Lease
from services.handoff.wire import Layout, Origin, arena_ref, transport_name
from vlmesh.v1 import common_pb2 as pb


class Transport(Protocol):
    """One kind of feature hand-off, producer side and consumer side."""

    kind: int  # the pb.Transport value it answers to
    label: str  # its arena's name in the vlmesh_arena_pages metric ("cuda", "shm", "inline")
    in_place: bool  # `open` returns the producer's memory itself, not a copy (see `verify`)
    arena: ArenaTable | None  # producer side: the arena its pages live in; None without pages

    @property
    def name(self) -> str:
        """The pb enum name (e.g. TRANSPORT_SHM): logs, spans and the metrics' transport label."""
        ...

    @property
    def accepted(self) -> bool:
        """Consumer side: whether this process can open references of this kind (it lists them in Info)."""
        ...

    def export(self, features: Sequence[torch.Tensor]) -> list[pb.TensorRef]:
        """Producer side: one reference per tensor, all readable by the consumer when this returns.

        Each tensor's run of pages is leased; if any write fails, the runs already written are released.
        RESOURCE_EXHAUSTED when the arena is full.
        """
        ...

    def release(self, lease_id: int) -> bool:
        """Producer side: end one reader's hold early (by reader id); False when this transport has none."""
        ...

    def reap(self) -> int:
        """Producer side: reclaim the runs whose lease expired unreleased; return how many."""
        ...

    @property
    def leased(self) -> int:
        """Producer side: how many pages are leased now."""
        ...

    def open(self, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        """Consumer side: the tensor a reference names, of `layout.shape` and `layout.dtype`.

        A copy, or (when `in_place`) the producer's memory, valid only while the lease holds.
        FAILED_PRECONDITION for a stale, forged or malformed reference; UNAVAILABLE when the
        producer is gone (its arena is then forgotten).
        """
        ...

    def verify(self, ref: pb.TensorRef) -> None:
        """Consumer side: FAILED_PRECONDITION unless what `open` returned for `ref` is still valid.

        Call it after the tensor was read in place: the lease still holding means the producer
        cannot have reused the pages meanwhile. A no-op for copies.
        """
        ...

    def close(self) -> None:
        """Producer side: unlink the arena. Consumer side: drop what was opened."""
        ...


class TransportBase:
    """What every transport object has: its kind, its metric label, its name, and whether this
    process accepts it (all do, except CUDA IPC without a GPU)."""

    kind: ClassVar[int]
    label: ClassVar[str]
    in_place: ClassVar[bool]

    @property
    def name(self) -> str:
        return transport_name(self.kind)

    @property
    def accepted(self) -> bool:
        return True


class ArenaTransport(TransportBase, abc.ABC):
    """The part SHM and CUDA_IPC share: leased runs of an arena's pages, references checked against its header.

    Subclasses say how a run is written (`_write`, `_finish`), what a reference carries
    besides the run (`_ref`) and how a checked run is read (`_read`).
    """

    def __init__(
        self, *, arena: ArenaTable | None = None, origin: Origin | None = None, views: ArenaViews | None = None
    ) -> None:
        self.arena = arena
        self.origin = origin or Origin("")
        self.views = views if views is not None else ArenaViews()

    # --- producer side ---

    def _producer_arena(self) -> ArenaTable:
        if self.arena is None:
            raise RuntimeError(f"this {self.name} transport was made for a consumer: it has no arena to write")
        return self.arena

    @abc.abstractmethod
    def _write(self, tensor: torch.Tensor) -> tuple[Lease, int]:
        """Copy one tensor into a fresh leased run of pages; return the lease and the run's byte offset."""

    @abc.abstractmethod
    def run_tensor(self, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        """The producer's own view of a run it exported as `ref` (no copy)."""

    def _finish(self, leases: list[Lease]) -> None:
        """Make written runs readable (signal readiness, publish their leases)."""

    def _ref(self, lease: Lease, offset: int, tensor: torch.Tensor) -> pb.TensorRef:
        return arena_ref(self.origin, self.kind, self._producer_arena().name, lease, offset, tensor)

    def export(self, features: Sequence[torch.Tensor]) -> list[pb.TensorRef]:
        arena = self._producer_arena()
        written: list[tuple[Lease, int, torch.Tensor]] = []
        try:
            for f in features:  # each [image_tokens, H]
                lease, offset = self._write(f)
                written.append((lease, offset, f))
            self._finish([lease for lease, _, _ in written])
        except BaseException:
            for lease, _, _ in written:
                arena.release(lease.id)  # nobody will ever read them
            raise
        return [self._ref(lease, offset, f) for lease, offset, f in written]

    def release(self, lease_id: int) -> bool:
        return self.arena is not None and self.arena.release(lease_id)

    def reap(self) -> int:
        return self.arena.reap() if self.arena is not None else 0

    @property
    def leased(self) -> int:
        return self.arena.leases.leased if self.arena is not None else 0

    # --- consumer side ---

    @abc.abstractmethod
    def _read(self, view: ArenaView, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        """The checked run's tensor (a copy, or in place)."""

    def _forget(self, name: str) -> None:
        """Drop what this process cached of an arena whose producer is gone."""
        self.views.forget(name)

    def open(self, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        if ref.nbytes != layout.nbytes:
            raise FailedPrecondition(f"tensor reference shape {layout.shape} does not match its {ref.nbytes} bytes")
        try:
            return self._read(self.views.get(ref.arena_id), ref, layout)
        except Unavailable:
            self._forget(ref.arena_id)  # the producer died; a new one makes a new arena
            raise

    def verify(self, ref: pb.TensorRef) -> None:
        if not self.in_place:
            return  # a copy: checked before and after it was made
        view = self.views.get(ref.arena_id)
        view.check(view.pages(ref.offset, ref.nbytes), ref.lease.id, margin_s=0.0)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
