"""Where encoded features go: leased slots of the vision process's arenas, or inline bytes.

A vision process on a GPU owns a CUDA arena (for an llm on the same GPU) and a host arena
(for one elsewhere on the host); on a CPU, only the host arena.
"""

from __future__ import annotations

import contextlib

import torch

from services.common.hostinfo import host_id
from services.common.leases import Lease
from services.common.metrics import ARENA_SLOTS
from services.common.shm_arena import ShmArena
from services.common.tensorref import TORCH_TO_PB, choose_transport, inline_ref
from vlmesh.v1 import common_pb2 as pb


class FeatureExporter:
    def __init__(self, slot_bytes: int, n_slots: int, ttl_s: float, device: torch.device, ready: str) -> None:
        self.host = host_id()
        self.shm = ShmArena(slot_bytes, n_slots, ttl_s)
        self.cuda = None
        self.gpu_uuid = ""
        if device.type == "cuda":
            from services.common.cuda_arena import CudaArena

            self.cuda = CudaArena(slot_bytes, n_slots, ttl_s, device, ready)
            self.gpu_uuid = self.cuda.gpu_uuid
        self.arenas = [a for a in (self.cuda, self.shm) if a is not None]
        for arena in self.arenas:
            kind = "cuda" if arena is self.cuda else "shm"
            ARENA_SLOTS.labels(kind, "leased").set_function(lambda a=arena: a.leases.leased)
            ARENA_SLOTS.labels(kind, "total").set(arena.n_slots)

    @property
    def offered(self) -> tuple[int, ...]:
        return ((pb.TRANSPORT_CUDA_IPC,) if self.cuda else ()) + (pb.TRANSPORT_SHM,)

    def transport_for(self, consumer: pb.ConsumerInfo) -> int:
        return choose_transport(self.host, self.gpu_uuid, self.offered, consumer)

    def export(self, features: list[torch.Tensor], transport: int) -> list[pb.TensorRef]:
        """One reference per [image_tokens, H] tensor; all readable when this returns."""
        if transport == pb.TRANSPORT_INLINE:
            return [inline_ref(f, self.host) for f in features]
        arena = self.cuda if transport == pb.TRANSPORT_CUDA_IPC else self.shm
        written: list[tuple[Lease, int, torch.Tensor]] = []
        try:
            for f in features:
                lease, offset = arena.write(f)
                written.append((lease, offset, f))
            if arena is self.cuda:
                self.cuda.finish([lease for lease, _, _ in written])
        except BaseException:
            for lease, _, _ in written:
                arena.release(lease.id)  # nobody will ever read them
            raise
        return [self._ref(arena, transport, lease, offset, f) for lease, offset, f in written]

    def _ref(self, arena, transport: int, lease: Lease, offset: int, f: torch.Tensor) -> pb.TensorRef:
        ref = pb.TensorRef(
            transport=transport,
            arena_id=arena.name,
            producer_host_id=self.host,
            gpu_uuid=self.gpu_uuid,
            offset=offset,
            nbytes=f.numel() * f.element_size(),
            shape=list(f.shape),
            dtype=TORCH_TO_PB[f.dtype],
            lease=pb.Lease(id=lease.id, expires_unix_ms=lease.expires_unix_ms),
            ready=pb.READY_SIGNAL_PRODUCER_SYNCED,
        )
        if transport == pb.TRANSPORT_CUDA_IPC:
            ref.cuda_ipc.CopyFrom(self.cuda.ipc)
            if self.cuda.ready == "event":
                ref.ready = pb.READY_SIGNAL_CUDA_EVENT
                ref.ready_event = self.cuda.event_handles[lease.slot]
        return ref

    def release(self, lease_ids) -> int:
        return sum(any(a.release(lease_id) for a in self.arenas) for lease_id in lease_ids)

    def reap(self) -> int:
        return sum(a.reap() for a in self.arenas)

    @property
    def leased(self) -> int:
        return sum(a.leases.leased for a in self.arenas)

    def close(self) -> None:
        for arena in self.arenas:
            with contextlib.suppress(Exception):
                arena.close()
