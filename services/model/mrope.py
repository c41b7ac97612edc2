"""Multimodal rotary positions (M-RoPE, Qwen2.5-VL): three position components a token.

A text token's components are equal, its plain position. A picture's tokens, a grid of rows x
cols, all start at the position where the picture starts: t stays there, h adds the token's row,
w its column; the text after the picture continues from that start plus max(rows, cols). The
rotary channels split between the components (`mrope_section`, in frequency pairs, both halves
of the head alike). After the prompt every position is text, so a decode step needs only the
sequence's offset (`delta`): position = index + delta.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.model.spec import ModelSpec


def mrope_columns(spec: ModelSpec, device: torch.device) -> torch.Tensor | None:
    """Which component (0 t, 1 h, 2 w) each rotary channel [d] turns by; None for plain RoPE."""
    sections = spec.text.mrope_section
    if sections is None:
        return None
    half = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sections)])
    return torch.cat([half, half]).to(device)


def prompt_positions(
    length: int, image_starts: Sequence[int], grids: Sequence[tuple[int, int]]
) -> tuple[np.ndarray, int]:
    """A prompt's positions [3, length] (int32) and its delta (positions after it are index + delta).

    `image_starts`: each picture's first index in the prompt; `grids`: its (rows, cols) of tokens.
    """
    out = np.empty((3, length), dtype=np.int32)
    index, pos = 0, 0  # the prompt index reached, and the position it takes
    for start, (rows, cols) in zip(image_starts, grids, strict=True):
        text = start - index
        out[:, index:start] = np.arange(pos, pos + text)
        pos += text
        out[0, start : start + rows * cols] = pos
        out[1, start : start + rows * cols] = pos + np.repeat(np.arange(rows), cols)
        out[2, start : start + rows * cols] = pos + np.tile(np.arange(cols), rows)
        index, pos = start + rows * cols, pos + max(rows, cols)
    out[:, index:] = np.arange(pos, pos + length - index)
    delta = int(out.max()) + 1 - length if length else 0
    return out, delta
