"""Pictures resized on the GPU (resample.py: float64 matmuls in cuBLAS) equal Pillow's, to the bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from services.model import resample

pytestmark = pytest.mark.gpu


def test_resizes_on_cuda_equal_pillow():
    rng = np.random.default_rng(0)
    sizes = [
        ((224, 224), (1024, 1024)),
        ((1024, 1024), (384, 384)),
        ((1280, 720), (1288, 728)),
        ((640, 480), (336, 252)),
    ]
    sizes += [(tuple(rng.integers(1, 700, 2)), tuple(rng.integers(1, 700, 2))) for _ in range(40)]
    for i, ((w, h), (width, height)) in enumerate(sizes):
        arr = rng.integers(0, 256, (int(h), int(w), 3), dtype=np.uint8)
        f = sorted(resample.FILTERS)[i % len(resample.FILTERS)]
        got = resample.resize(torch.from_numpy(arr).cuda(), int(width), int(height), f).cpu().numpy()
        want = np.asarray(Image.fromarray(arr).resize((int(width), int(height)), resample=f))
        np.testing.assert_array_equal(got, want, err_msg=f"{w}x{h} -> {width}x{height}, filter {f}")
