"""The pictures `vlmesh up` warms the mesh up with: --warmup-images DIR, or one synthetic picture."""

from __future__ import annotations

import io
from pathlib import Path

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
