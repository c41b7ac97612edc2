"""INLINE: the tensor's bytes ride in the reference itself.

The fallback that always works (another host, no shared memory): no arena, no lease,
a copy on both ends. The gRPC message grows by the tensor's size (4.7 MB for one
[576, 4096] bf16 image).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.errors import FailedPrecondition
from services.handoff.transport import TransportBase
from services.handoff.wire import Layout, Origin, inline_ref
from vlmesh.v1 import common_pb2 as pb


class InlineTransport(TransportBase):
    """TRANSPORT_INLINE: bytes in the TensorRef; nothing to lease, release or verify."""

    kind = pb.TRANSPORT_INLINE
    label = "inline"
    in_place = False
    arena = None

    def __init__(self, origin: Origin | None = None) -> None:
        self.origin = origin or Origin("")

    def export(self, features: Sequence[torch.Tensor]) -> list[pb.TensorRef]:
        return [inline_ref(f, self.origin.host) for f in features]

    def release(self, lease_id: int) -> bool:
        return False  # inline references hold no lease

    def reap(self) -> int:
        return 0

    @property
    def leased(self) -> int:
        return 0

    def open(self, ref: pb.TensorRef, layout: Layout) -> torch.Tensor:
        if len(ref.inline_data) != layout.nbytes:
            raise FailedPrecondition(f"inline tensor of shape {layout.shape} carries {len(ref.inline_data)} bytes")
        # bytearray: a writable copy (torch.frombuffer warns on read-only bytes).
        return torch.frombuffer(bytearray(ref.inline_data), dtype=layout.dtype).view(layout.shape)

    def verify(self, ref: pb.TensorRef) -> None:
        pass  # a copy: nothing can change under it

    def close(self) -> None:
        pass
