"""The producer role (the vision process): where encoded features go.

A producer on a GPU owns a CUDA arena (for a consumer on the same GPU, or over the peer link on
another GPU of the host) and a host arena (for one elsewhere on the host); on a CPU, only the
host arena. Inline bytes are always
possible. It negotiates a transport per consumer, exports through it, and takes leases
back early (`release`) or when they expire (`reap`).

It also keeps features under content keys (the vision feature cache): `export` with keys
keeps the written runs once their readers are done, and `lookup` hands out a new lease
reference on a kept run, with no copy when the consumer takes that arena's transport.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch

from services.common.errors import InvalidArgument, ResourceExhausted
from services.common.hostinfo import host_id
from services.common.metrics import ARENA_PAGES
from services.handoff.inline import InlineTransport
from services.handoff.shm import ShmTransport
from services.handoff.transport import ArenaTransport, Transport
from services.handoff.wire import Origin, choose_transport, layout, transport_name
from vlmesh.v1 import common_pb2 as pb


class Producer:
    """Exports feature tensors to consumers: one transport object per kind it offers."""

    def __init__(
        self, page_bytes: int, n_pages: int, ttl_s: float, device: torch.device, ready: str, keep: int = 0
    ) -> None:
        """Arenas of `n_pages` pages of `page_bytes`, leases of `ttl_s`; CUDA IPC too when `device` is a GPU.

        A tensor takes a run of pages (one, where it fits one). `ready` ("sync" or "event") is how
        a CUDA run's reader learns it is written. `keep` more pages per arena hold kept features
        (0: nothing is kept).
        """
        self.host = host_id()
        self.gpu_uuid = ""
        arenas: list[ArenaTransport] = []
        readers: list[ArenaTransport] = []  # the arena transports it offers: the peer form shares the CUDA arena
        if device.type == "cuda":
            # CUDA is initialised only on a GPU
            from services.handoff.cuda import CudaIpcPeerTransport, CudaIpcTransport

            cuda = CudaIpcTransport.producer(self.host, page_bytes, n_pages + keep, ttl_s, device, ready, keep)
            self.gpu_uuid = cuda.gpu_uuid
            arenas.append(cuda)
            readers += [cuda, CudaIpcPeerTransport.sharing(cuda)]
        origin = Origin(self.host, self.gpu_uuid)
        shm = ShmTransport.producer(origin, page_bytes, n_pages + keep, ttl_s, keep)
        arenas.append(shm)
        readers.append(shm)
        # Best first; INLINE last, always possible and never offered (negotiation adds it).
        self._arenas: list[ArenaTransport] = arenas  # each arena once
        self._readers = readers
        self._transports: list[Transport] = [*readers, InlineTransport(origin)]
        self._by_kind = {t.kind: t for t in self._transports}
        for t in self._arenas:
            ARENA_PAGES.labels(t.label, "leased").set_function(lambda t=t: t.leased)
            ARENA_PAGES.labels(t.label, "kept").set_function(lambda t=t: t.arena.leases.kept)
            ARENA_PAGES.labels(t.label, "total").set(t.arena.n_pages if t.arena is not None else 0)

    @property
    def keeps(self) -> bool:
        """Whether its arenas keep features under content keys (`keep` > 0)."""
        return any(t.arena is not None and t.arena.leases.keep_limit > 0 for t in self._arenas)

    @property
    def offered(self) -> tuple[int, ...]:
        """The arena transports this producer offers, best first (INLINE goes without saying)."""
        return tuple(t.kind for t in self._readers)

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

    def export(
        self,
        features: Sequence[torch.Tensor],
        consumer: pb.ConsumerInfo | Transport,
        keys: Sequence[bytes] | None = None,
    ) -> list[pb.TensorRef]:
        """One reference per [image_tokens, H] tensor; all readable when this returns.

        `consumer` is the consumer's ConsumerInfo (negotiated here) or the transport that
        `negotiate` already chose for it (a caller that refuses a bad consumer before any work).
        With `keys` (one content key per tensor), the references carry them and the runs are
        kept under them where the arena has room; for an INLINE consumer a copy is kept in the
        best arena, for the next consumer of that key.
        """
        transport = self.negotiate(consumer) if isinstance(consumer, pb.ConsumerInfo) else consumer
        refs = transport.export(features)
        for ref, tensor, key in zip(refs, features, keys or (), strict=False):
            ref.content_key = key
            if transport.arena is not None:
                transport.arena.leases.keep(ref.lease.id, key, _copy(ref))
            elif self._arenas:
                self._keep_copy(self._arenas[0], tensor, key)
        return refs

    @staticmethod
    def _keep_copy(home: ArenaTransport, tensor: torch.Tensor, key: bytes) -> None:
        assert home.arena is not None
        try:
            (ref,) = home.export([tensor])
        except ResourceExhausted:
            return  # caching is best effort: a full arena serves without it
        ref.content_key = key
        home.arena.leases.keep(ref.lease.id, key, _copy(ref))
        home.release(ref.lease.id)  # nobody reads it now: idle when kept, freed when not

    def lookup(self, key: bytes, transport: Transport) -> pb.TensorRef | None:
        """A reference through `transport` to the features kept under `key`; None on a miss.

        Kept in `transport`'s own arena: one more reference to the same run and lease (no
        copy, no write). Kept in another arena (a consumer that takes another transport):
        copied out of it, through `transport`.
        """
        for home in self._arenas:
            assert home.arena is not None
            found = home.arena.share(key)
            if found is None:
                continue
            lease, reader = found
            ref = _copy(lease.meta)
            ref.lease.expires_unix_ms, ref.lease.reader = lease.expires_unix_ms, reader
            if home.arena is transport.arena:  # this transport reads that arena (CUDA_IPC, or its peer form)
                ref.transport = transport.kind
                return ref
            try:
                (out,) = transport.export([home.run_tensor(ref, layout(ref))])
            finally:
                home.release(reader)
            out.content_key = key
            return out
        return None

    def release(self, lease_ids: Iterable[int]) -> int:
        """End readers' holds early (the consumer has read them), by reader id (a reference's
        `lease.reader`, or its `lease.id` when that is 0); return how many were held."""
        return sum(any(t.release(lease_id) for t in self._arenas) for lease_id in lease_ids)

    def reap(self) -> int:
        """Reclaim the runs whose lease expired unreleased; return how many."""
        return sum(t.reap() for t in self._arenas)

    @property
    def leased(self) -> int:
        """Pages leased now, over all arenas."""
        return sum(t.leased for t in self._arenas)

    def close(self) -> None:
        """Unlink the arenas (consumers still attached keep their mappings until they detach)."""
        for t in self._transports:
            with contextlib.suppress(Exception):
                t.close()


def _copy(ref: object) -> pb.TensorRef:
    out = pb.TensorRef()
    out.CopyFrom(ref)  # type: ignore[arg-type]
    return out
