"""The producer role (the vision process): where encoded features go.

A producer on a GPU owns a CUDA arena (for a consumer on the same GPU) and a host arena
(for one elsewhere on the host); on a CPU, only the host arena. Inline bytes are always
possible. It negotiates a transport per consumer, exports through it, and takes leases
back early (`release`) or when they expire (`reap`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch

from services.common.errors import InvalidArgument
from services.common.hostinfo import host_id
from services.common.metrics import ARENA_SLOTS
from services.handoff.inline import InlineTransport
from services.handoff.shm import ShmTransport
from services.handoff.transport import Transport
from services.handoff.wire import Origin, choose_transport, transport_name
from vlmesh.v1 import common_pb2 as pb


class Producer:
    """Exports feature tensors to consumers: one transport object per kind it offers."""

    def __init__(self, slot_bytes: int, n_slots: int, ttl_s: float, device: torch.device, ready: str) -> None:
        """Arenas of `n_slots` slots of `slot_bytes`, leases of `ttl_s`; CUDA IPC too when `device` is a GPU.

        `ready` ("sync" or "event") is how a CUDA slot's reader learns it is written.
        """
        self.host = host_id()
        self.gpu_uuid = ""
        arenas: list[Transport] = []
        if device.type == "cuda":
            from services.handoff.cuda import CudaIpcTransport  # CUDA is initialised only on a GPU

            cuda = CudaIpcTransport.producer(self.host, slot_bytes, n_slots, ttl_s, device, ready)
            self.gpu_uuid = cuda.gpu_uuid
            arenas.append(cuda)
        origin = Origin(self.host, self.gpu_uuid)
        arenas.append(ShmTransport.producer(origin, slot_bytes, n_slots, ttl_s))
        # Best first; INLINE last, always possible and never offered (negotiation adds it).
        self._arenas: list[Transport] = arenas
        self._transports: list[Transport] = [*arenas, InlineTransport(origin)]
        self._by_kind = {t.kind: t for t in self._transports}
        for t in self._arenas:
            ARENA_SLOTS.labels(t.label, "leased").set_function(lambda t=t: t.leased)
            ARENA_SLOTS.labels(t.label, "total").set(t.arena.n_slots if t.arena is not None else 0)

    @property
    def offered(self) -> tuple[int, ...]:
        """The arena transports this producer offers, best first (INLINE goes without saying)."""
        return tuple(t.kind for t in self._arenas)

    @property
    def transports(self) -> list[int]:
        """Every transport it can export through, best first: what its Info lists."""
        return [t.kind for t in self._transports]

    @property
    def arena_names(self) -> list[str]:
        """The arenas' ids (their header segments' names), for the start-up log."""
        return [t.arena.name for t in self._arenas if t.arena is not None]

    def transport(self, kind: int) -> Transport:
        """The transport object of one kind; INVALID_ARGUMENT when this producer has none."""
        transport = self._by_kind.get(kind)
        if transport is None:
            raise InvalidArgument(f"this producer does not offer {transport_name(kind)}")
        return transport

    def negotiate(self, consumer: pb.ConsumerInfo) -> Transport:
        """The transport for this consumer (a fallback is logged and counted); INVALID_ARGUMENT if none works."""
        return self._by_kind[choose_transport(self.host, self.gpu_uuid, self.offered, consumer)]

    def export(self, features: Sequence[torch.Tensor], consumer: pb.ConsumerInfo | Transport) -> list[pb.TensorRef]:
        """One reference per [image_tokens, H] tensor; all readable when this returns.

        `consumer` is the consumer's ConsumerInfo (negotiated here) or the transport that
        `negotiate` already chose for it (a caller that refuses a bad consumer before any work).
        """
        transport = self.negotiate(consumer) if isinstance(consumer, pb.ConsumerInfo) else consumer
        return transport.export(features)

    def release(self, lease_ids: Iterable[int]) -> int:
        """End leases early (the consumer has read them); return how many were held."""
        return sum(any(t.release(lease_id) for t in self._arenas) for lease_id in lease_ids)

    def reap(self) -> int:
        """Reclaim the slots whose lease expired unreleased; return how many."""
        return sum(t.reap() for t in self._arenas)

    @property
    def leased(self) -> int:
        """Slots leased now, over all arenas."""
        return sum(t.leased for t in self._arenas)

    def close(self) -> None:
        """Unlink the arenas (consumers still attached keep their mappings until they detach)."""
        for t in self._transports:
            with contextlib.suppress(Exception):
                t.close()
