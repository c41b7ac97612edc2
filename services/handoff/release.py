"""The lease release RPC: a consumer (or the gateway, for a consumer that never read them) hands slots back.

Releasing is an optimisation: the producer's TTL reclaims a lease whose release got lost,
so a failed release is logged, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc

from services.handoff.wire import lease_ids
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import vision_pb2, vision_pb2_grpc

log = logging.getLogger(__name__)


async def release_leases(
    vision: vision_pb2_grpc.VisionStub | None, refs: Iterable[pb.TensorRef], timeout_s: float
) -> None:
    """Ask the producer (`vision`; None: nobody to ask) to end the leases `refs` hold.

    Inline references hold none; with nothing to release no call is made.
    """
    ids = lease_ids(refs)
    if not ids or vision is None:
        return
    try:
        await vision.Release(vision_pb2.ReleaseRequest(lease_ids=ids), timeout=timeout_s)
    except grpc.RpcError as err:
        log.warning("lease release failed (the TTL will reclaim them): %s", err.code().name)
