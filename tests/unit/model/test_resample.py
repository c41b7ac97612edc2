"""resample.resize gives Pillow's pixels to the bit, for every convolution filter and shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from services.model import resample

FILTERS = sorted(resample.FILTERS)


def pillow(arr: np.ndarray, width: int, height: int, f: int) -> np.ndarray:
    return np.asarray(Image.fromarray(arr).resize((width, height), resample=f))


def ours(arr: np.ndarray, width: int, height: int, f: int) -> np.ndarray:
    return resample.resize(torch.from_numpy(arr), width, height, f).numpy()


@settings(max_examples=150, deadline=None)
@given(
    size=st.tuples(*[st.integers(1, 160)] * 4),
    f=st.sampled_from(FILTERS),
    seed=st.integers(0, 2**16),
)
def test_any_size_and_filter_equals_pillow(size, f, seed):
    w, h, width, height = size
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    np.testing.assert_array_equal(ours(arr, width, height, f), pillow(arr, width, height, f))


@pytest.mark.parametrize(
    "src,dst",
    [
        ((224, 224), (1024, 1024)),  # W1's picture to SAM's side
        ((1024, 1024), (384, 384)),  # SAM's square to SigLIP's
        ((100, 100), (150, 60)),  # the height shrinks more than twice the width: vertical pass first
        ((100, 300), (30, 100)),  # the height shrinks, but not twice as much: horizontal first
        ((37, 91), (200, 17)),
        ((1280, 720), (1288, 728)),
        ((5, 700), (224, 224)),
    ],
)
def test_the_shapes_the_families_meet(src, dst):
    arr = np.random.default_rng(7).integers(0, 256, (src[1], src[0], 3), dtype=np.uint8)
    for f in FILTERS:
        np.testing.assert_array_equal(ours(arr, *dst, f), pillow(arr, *dst, f), err_msg=f"filter {f}")


def test_a_smooth_picture_and_its_extremes():
    """Clipping: a black-white edge makes bicubic and Lanczos overshoot past 0 and 255."""
    arr = np.zeros((64, 64, 3), dtype=np.uint8)
    arr[:, 32:] = 255
    arr[20:40, :, 1] = np.linspace(0, 255, 64, dtype=np.uint8)
    for f in FILTERS:
        np.testing.assert_array_equal(ours(arr, 150, 41, f), pillow(arr, 150, 41, f), err_msg=f"filter {f}")


def test_large_pictures_go_in_slices(monkeypatch):
    monkeypatch.setattr(resample, "_CHUNK", 500)  # many slices per pass
    arr = np.random.default_rng(3).integers(0, 256, (137, 211, 3), dtype=np.uint8)
    for width, height in [(400, 50), (50, 400), (90, 300)]:
        np.testing.assert_array_equal(ours(arr, width, height, 3), pillow(arr, width, height, 3))


def test_nearest_is_refused():
    assert not resample.supported(Image.Resampling.NEAREST)
    with pytest.raises(ValueError, match="convolution filters"):
        resample.resize(torch.zeros(4, 4, 3, dtype=torch.uint8), 2, 2, Image.Resampling.NEAREST)
