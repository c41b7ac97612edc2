"""Shared fixtures: a tiny random LLaVA checkpoint and a real three-process mesh on it."""

from __future__ import annotations

import io
import os
import time
import urllib.request

import numpy as np
import pytest
from PIL import Image

from services.launcher import Mesh, MeshOptions


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random LLaVA written by transformers' save_pretrained (center crop on, 32 px, 16 image tokens)."""
    from services.model.tiny import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), seed=0)


def image_bytes(seed: int, size: tuple[int, int] = (48, 40), fmt: str = "PNG") -> bytes:
    """A random-noise picture (width, height) encoded as `fmt`."""
    rng = np.random.default_rng(seed)
    arr = (rng.random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def pil_clip_processor_class():
    """transformers' PIL implementation of CLIPImageProcessor: the reference we match.

    Where torchvision is installed (the GPU machine), `CLIPImageProcessor` is the
    torchvision backend, whose bicubic resize differs from Pillow's.
    """
    try:
        from transformers import CLIPImageProcessorPil

        return CLIPImageProcessorPil
    except ImportError:  # older transformers: the class is the PIL one
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor


def mesh_options(model, **overrides) -> MeshOptions:
    """A CPU mesh on ephemeral ports, one torch thread per service (CI has 2 cores)."""
    opts = {
        "model": str(model),
        "gateway_port": 0,
        "vision_port": 0,
        "llm_port": 0,
        "device": "cpu",
        "threads": 1,
        "metrics_ports": (0, 0, 0),
        "warmup_requests": 1,
        "log_level": "warning",
        "extra_env": {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    }
    opts.update(overrides)
    return MeshOptions.from_flags(**opts)


@pytest.fixture(scope="session")
def mesh(tiny_model):
    """gateway, vision and llm as three real processes on ephemeral ports."""
    with Mesh(mesh_options(tiny_model)) as running:
        running.start(progress=lambda msg: None)
        yield running


def scrape(port: int) -> str:
    """One Prometheus /metrics page of a mesh server."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def sample(text: str, series: str) -> float | None:
    """The value of one exposition line, e.g. `vlmesh_kv_slots{state="used"}`; None if absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def settle(port: int, series: str, want: float, timeout: float = 10.0, absent_is_zero: bool = False) -> float | None:
    """Poll a series until it equals `want` (releases are asynchronous); return the last value seen.

    `absent_is_zero`: a labelled gauge that was never touched is not exported; count it as 0.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = sample(scrape(port), series)
        if got == want or (absent_is_zero and got is None and want == 0) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)
