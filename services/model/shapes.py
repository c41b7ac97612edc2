"""The synthetic task of the demo model: one filled shape on a light background.

The generator (documented here, used by training, tests and `make demo`):
- **Shape**: circle, square, triangle (equilateral) or star (five-pointed); all but the
  circle are rotated by a uniform angle in [0, 360).
- **Size**: the diameter of the shape's circumscribed circle is 20–60% of the shorter image
  side; the center is uniform over the positions that keep the whole shape inside.
- **Color**: one of six canonical RGB values, each channel jittered uniformly by ±25.
- **Background**: a plain color with each channel uniform in 200–255, plus Gaussian pixel
  noise (sigma 4, rounded), cut at a random offset from one fixed 1024x1024 noise field
  (cheaper than drawing fresh noise per pixel).
- **Image size**: width uniform in 64–512 px, height uniform in the part of 64–512 that keeps
  the aspect ratio at most 2:1.

Everything is drawn from a numpy Generator, so a seed fixes the picture.
"""

from __future__ import annotations

import functools
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 30),
    "purple": (140, 50, 170),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle", "star")
COLOR_JITTER = 25
NOISE_SIGMA = 4.0

# prompt -> answer template, exact strings (lower case, no trailing period)
PROMPTS: dict[str, str] = {
    "What is in the image?": "a {color} {shape}",
    "What color is the shape?": "{color}",
    "What shape is it?": "{shape}",
}


@functools.cache
def _noise_field() -> np.ndarray:
    """[1024, 1024, 3] int16 Gaussian noise, the same in every process."""
    return np.random.default_rng(20261129).normal(0.0, NOISE_SIGMA, (1024, 1024, 3)).round().astype(np.int16)


@dataclass(frozen=True)
class Picture:
    image: Image.Image
    color: str
    shape: str

    def answer(self, prompt: str) -> str:
        return PROMPTS[prompt].format(color=self.color, shape=self.shape)


def _polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Vertices of a regular shape inscribed in the circle (cx, cy, r), rotated by `angle`."""
    if shape == "square":
        radii, count = [r], 4
    elif shape == "triangle":
        radii, count = [r], 3
    else:  # star: alternate outer and inner radius (inner/outer of a regular pentagram)
        radii, count = [r, r * 0.381966], 10
    return [
        (
            cx + radii[i % len(radii)] * math.cos(angle + 2 * math.pi * i / count),
            cy + radii[i % len(radii)] * math.sin(angle + 2 * math.pi * i / count),
        )
        for i in range(count)
    ]


def render(rng: np.random.Generator, color: str | None = None, shape: str | None = None) -> Picture:
    """Draw one picture; color and shape are random unless given."""
    color = color or list(COLORS)[rng.integers(len(COLORS))]
    shape = shape or SHAPES[rng.integers(len(SHAPES))]
    width = int(rng.integers(64, 513))
    height = int(rng.integers(max(64, math.ceil(width / 2)), min(512, 2 * width) + 1))
    background = rng.integers(200, 256, size=3)
    oy, ox = rng.integers(0, 1024 - height + 1), rng.integers(0, 1024 - width + 1)
    pixels = background.astype(np.int16) + _noise_field()[oy : oy + height, ox : ox + width]
    img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    fill = tuple(
        int(v) for v in np.clip(np.array(COLORS[color]) + rng.integers(-COLOR_JITTER, COLOR_JITTER + 1, 3), 0, 255)
    )
    r = rng.uniform(0.2, 0.6) * min(width, height) / 2
    cx, cy = rng.uniform(r, width - r), rng.uniform(r, height - r)
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon(_polygon(shape, cx, cy, r, rng.uniform(0, 2 * math.pi)), fill=fill)
    return Picture(img, color, shape)


def encode(img: Image.Image, fmt: str, quality: int = 90) -> bytes:
    """Encode to bytes in a Pillow format (JPEG, PNG, WEBP, BMP, ...)."""
    buf = io.BytesIO()
    kwargs = {"quality": quality} if fmt in ("JPEG", "WEBP") else {}
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()
