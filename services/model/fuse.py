"""Fusing linear layers that read the same input into one (q/k/v; gate/up).

Checkpoints keep the projections apart. One matmul over their concatenated weights reads the
input once and launches once, and its wider output fills more of the GPU: the decode step is
bound by reading weights, and a ViT layer's narrow products each run a partial wave of tiles,
where the fused one costs little more than one of them (docs/PERF.md).
"""

from __future__ import annotations

import torch
from torch import nn

from services.model.qlinear import Fp8Linear


@torch.no_grad()
def fuse_linears(*linears: nn.Linear | Fp8Linear) -> nn.Linear | Fp8Linear:
    """One layer whose output is the given layers' outputs, concatenated in order (biases too): an
    nn.Linear, or an Fp8Linear of fp8 ones (a checkpoint stored in fp8; per-channel scales concatenate)."""
    has_bias = [lin.bias is not None for lin in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fuse_linears: some of these layers have a bias and some do not")
    fp8 = [isinstance(lin, Fp8Linear) for lin in linears]
    if all(fp8):
        bias = torch.cat([lin.bias for lin in linears]) if all(has_bias) else None  # type: ignore[misc]
        return Fp8Linear(torch.cat([lin.qdata for lin in linears]), torch.cat([lin.scale for lin in linears]), bias)  # type: ignore[union-attr]
    if any(fp8):
        raise ValueError("fuse_linears: some of these layers are stored in fp8 and some are not")
    w = torch.cat([lin.weight for lin in linears])  # type: ignore[union-attr]
    fused = nn.Linear(w.shape[1], w.shape[0], bias=all(has_bias), device=w.device, dtype=w.dtype)
    fused.weight = nn.Parameter(w, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused
