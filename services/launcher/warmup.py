"""`vlmesh up`'s warm-up: requests through the whole mesh before it reports ready, with the
pictures of --warmup-images DIR, or one synthetic picture."""

from __future__ import annotations

import io
import time
from pathlib import Path

import grpc

from services.common.tls import sync_channel
from services.launcher.ports import MeshError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


def warmup_images(directory: str | None, scratch: Path | None = None) -> list[Path]:
    """Images from --warmup-images DIR (MeshError when it has none); without DIR, one synthetic
    picture written into `scratch`, the mesh's temporary directory (without one: none)."""
    if directory:
        root = Path(directory)
        found = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if root.is_dir() else []
        if not found:
            raise MeshError(f"--warmup-images {directory}: no image files there")
        return found
    if scratch is None:
        return []
    from PIL import Image

    path = scratch / "warmup.png"
    buf = io.BytesIO()
    Image.new("RGB", (224, 224), (230, 230, 230)).save(buf, format="PNG")
    path.write_bytes(buf.getvalue())
    return [path]


def warm_up(mesh, pictures: list[Path], n: int, key: str, progress) -> None:
    """`n` requests through `mesh` (a started Mesh), MeshError naming the one that failed.

    Under --tenants the gateway takes this run's own `key` (WARMUP_KEY_ENV) as an internal
    tenant; without, auth is off and the header is ignored.
    """
    from services.client import build_request
    from vlmesh.v1 import gateway_pb2_grpc

    if n <= 0:
        return
    auth = [("authorization", f"Bearer {key}")]
    progress(f"warming up: {n} requests through the mesh")
    start = time.perf_counter()
    with sync_channel(mesh.target("gateway"), mesh.credentials()) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for i in range(n):
            mesh.check_alive()
            path = pictures[i % len(pictures)]
            req = build_request(path, "What is in the image?", 4, None, None, [])
            try:
                stub.GenerateUnary(req, metadata=auth, timeout=mesh.opts.start_timeout_s)
            except grpc.RpcError as err:
                mesh.check_alive()
                raise MeshError(
                    f"warm-up request {i + 1} with {path} failed: {err.code().name}: {err.details()}"
                ) from err
    progress(f"warm-up done in {time.perf_counter() - start:.1f}s")
