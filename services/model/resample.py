"""Pillow's resize, to the bit, on any torch device.

Pillow resizes 8-bit pictures with separable filters (libImaging/Resample.c): per output pixel a
row of weights in 22-bit fixed point, a horizontal pass rounded back to uint8, then a vertical
pass. Each pass is an integer matrix product, which float64 computes exactly (every partial sum
stays below 2^31), so on a GPU one picture costs a few small matmuls instead of Pillow's
milliseconds on a core, and the pixels equal Pillow's, which transformers' processors use.
Pillow 13 runs the vertical pass first where the height shrinks more than twice as much as the
width; earlier versions always start with the horizontal one. Each pass rounds, so the order
shows in the pixels and follows the installed Pillow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np
import PIL
import torch
from PIL import Image

_BITS = 22  # Resample.c: PRECISION_BITS = 32 - 8 - 2
_HALF = float(1 << (_BITS - 1))
_CHUNK = 1 << 24  # float64 values per slice of a pass (128 MiB)
_ONE = float(1 << _BITS)
_VERTICAL_FIRST_RULE = int(PIL.__version__.split(".")[0]) >= 13
_F054, _F046 = float(np.float32(0.54)), float(np.float32(0.46))  # Resample.c writes 0.54f, 0.46f


def _box(x: float) -> float:
    return 1.0 if -0.5 < x <= 0.5 else 0.0


def _bilinear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


def _hamming(x: float) -> float:
    x = abs(x)
    if x == 0.0:
        return 1.0
    if x >= 1.0:
        return 0.0
    x = x * math.pi
    return math.sin(x) / x * (_F054 + _F046 * math.cos(x))


def _bicubic(x: float) -> float:
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    return _sinc(x) * _sinc(x / 3.0) if -3.0 <= x < 3.0 else 0.0


# Pillow's filter number -> (filter, support). NEAREST is not a convolution (Pillow samples).
FILTERS: dict[int, tuple[Callable[[float], float], float]] = {
    int(Image.Resampling.BOX): (_box, 0.5),
    int(Image.Resampling.BILINEAR): (_bilinear, 1.0),
    int(Image.Resampling.HAMMING): (_hamming, 1.0),
    int(Image.Resampling.BICUBIC): (_bicubic, 2.0),
    int(Image.Resampling.LANCZOS): (_lanczos, 3.0),
}


def supported(resample: int) -> bool:
    """Whether `resize` reproduces this Pillow filter (all but NEAREST)."""
    return int(resample) in FILTERS


@lru_cache(maxsize=256)
def _taps(in_size: int, out_size: int, resample: int) -> tuple[np.ndarray, np.ndarray]:
    """Resample.c's precompute_coeffs + normalize_coeffs_8bpc for one axis of a whole-picture
    resize: the input index [out, ksize] and integer weight [out, ksize] (float64) of each tap;
    the unused taps of a row point at its first input with weight 0."""
    fn, support = FILTERS[resample]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = support * filterscale
    ss = 1.0 / filterscale
    ksize = math.ceil(support) * 2 + 1
    index = np.zeros((out_size, ksize), dtype=np.int64)
    weight = np.zeros((out_size, ksize), dtype=np.float64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)  # C's (int): toward zero
        xmax = min(int(center + support + 0.5), in_size) - xmin
        k = [fn((x + xmin - center + 0.5) * ss) for x in range(xmax)]
        ww = sum(k)  # summed in order, as the C loop does
        index[xx] = xmin
        index[xx, :xmax] += np.arange(xmax)
        for x, w in enumerate(k):
            w = w / ww if ww != 0.0 else w
            weight[xx, x] = int(-0.5 + w * _ONE) if w < 0 else int(0.5 + w * _ONE)
    return index, weight


@lru_cache(maxsize=64)
def _taps_on(in_size: int, out_size: int, resample: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    index, weight = _taps(in_size, out_size, resample)
    return torch.from_numpy(index).to(device), torch.from_numpy(weight).to(device)


def _pass(x: torch.Tensor, out_size: int, resample: int, dim: int) -> torch.Tensor:
    """One pass along `dim` (0: rows, 1: columns) of x [h, w, C] uint8: a product with the dense
    [out, in] weight matrix in float64, rounded and clipped to bytes as Resample.c's clip8 does.
    The other axis goes in slices of about `_CHUNK` float64 values, so a large picture's
    temporaries stay small."""
    index, weight = _taps_on(x.shape[dim], out_size, resample, x.device)
    # Dense per pass, not cached: one scatter kernel, where the matrix of a 4000-px side going to
    # 1280 is 40 MB of float64 and the cache's 64 entries could hold gigabytes of the device.
    k = torch.zeros(out_size, x.shape[dim], dtype=torch.float64, device=x.device).scatter_add_(1, index, weight)
    shape = list(x.shape)
    shape[dim] = out_size
    out = x.new_empty(shape)
    other = 1 - dim
    step = max(1, _CHUNK // (max(x.shape[dim], out_size) * x.shape[2]))
    for s in range(0, x.shape[other], step):
        part = x.narrow(other, s, min(step, x.shape[other] - s)).to(torch.float64)
        y = torch.einsum("oi,iwc->owc", k, part) if dim == 0 else torch.einsum("oi,hic->hoc", k, part)
        out.narrow(other, s, part.shape[other]).copy_(torch.floor_divide(y + _HALF, _ONE).clamp_(0, 255))
    return out


def resize(img: torch.Tensor, width: int, height: int, resample: int) -> torch.Tensor:
    """uint8 [h, w, C] -> uint8 [height, width, C], equal to Pillow's `Image.resize((width, height),
    resample)` of the same picture, on `img`'s device."""
    resample = int(resample)
    if resample not in FILTERS:
        raise ValueError(f"resample {resample} is not one of Pillow's convolution filters {sorted(FILTERS)}")
    h, w = img.shape[0], img.shape[1]
    if (h, w) == (height, width):
        return img.clone()
    x = img
    vertical_first = _VERTICAL_FIRST_RULE and h - height > 0 and h - height > (w - width) * 2
    if vertical_first and height != h:
        x = _pass(x, height, resample, dim=0)
    if width != w:
        x = _pass(x, width, resample, dim=1)
    if not vertical_first and height != h:
        x = _pass(x, height, resample, dim=0)
    return x
