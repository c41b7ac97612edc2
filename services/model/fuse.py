"""Fusing linear layers that read the same input into one (q/k/v; gate/up), and padding one's
widths with zeros.

Checkpoints keep the projections apart. One matmul over their concatenated weights reads the
input once and launches once, and its wider output fills more of the GPU: the decode step is
bound by reading weights, and a ViT layer's narrow products each run a partial wave of tiles,
where the fused one costs little more than one of them (docs/PERF.md). A bf16 matrix whose rows
are not a whole number of 16-byte units cannot take cuBLAS's aligned kernels: padded with zero
weights to a round width, the same product runs on them.
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


@torch.no_grad()
def pad_linear(lin: nn.Linear, out_features: int | None = None, in_features: int | None = None) -> nn.Linear:
    """`lin` with zero rows (outputs, their bias 0) and zero columns (inputs) appended up to these
    widths: the outputs it had are unchanged, the new ones are 0, and new inputs are ignored."""
    n, k = lin.weight.shape
    out_features, in_features = out_features or n, in_features or k
    if out_features < n or in_features < k:
        raise ValueError(f"pad_linear: {n}x{k} cannot be padded to {out_features}x{in_features}")
    padded = nn.Linear(
        in_features, out_features, bias=lin.bias is not None, device=lin.weight.device, dtype=lin.weight.dtype
    )
    padded.weight = nn.Parameter(
        torch.nn.functional.pad(lin.weight, (0, in_features - k, 0, out_features - n)), requires_grad=False
    )
    if lin.bias is not None:
        padded.bias = nn.Parameter(torch.nn.functional.pad(lin.bias, (0, out_features - n)), requires_grad=False)
    return padded
