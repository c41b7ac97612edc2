"""The decoder's weight-only quantized projections, as modules of plain tensors.

torchao quantizes the weights (services/model/quantize.py); these modules then hold its data
as ordinary parameters and call the matmul its tensor subclass would dispatch to. Why not keep
the subclass: torch.compile traces through a tensor subclass's dispatch on every compile, about
30 s per CUDA-graph bucket on the H200 (docs/PERF.md), so an engine of some 50 captured graphs
took 25 minutes to warm up. Plain tensors compile as fast as bf16.

`project(x, layer, linear)` is how the model calls any projection: a plain nn.Linear through
`linear` (F.linear's signature: the decode step passes services/model/gemv.py's), a quantized
one through its own kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.model import int8_mm


def project(x: torch.Tensor, layer: nn.Module, linear: Callable = F.linear) -> torch.Tensor:
    """x [N, K] through one projection -> [N, out]."""
    if isinstance(layer, nn.Linear):
        return linear(x, layer.weight, layer.bias)
    return layer(x)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Int8Linear(nn.Module):
    """y = (x Q^T) s (+ b): Q [out, in] int8, s [out] fp32, one scale per output channel."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.qdata = _frozen(q.contiguous())
        self.scale = _frozen(s.reshape(-1).float().contiguous())
        self.bias = None if bias is None else _frozen(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if int8_mm.applies(x):
            y = int8_mm.linear(x, self.qdata, self.scale)
        else:  # torchao's weight-only int8 math (the CPU, fp32 on CUDA)
            y = F.linear(x, self.qdata.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """tinygemm's grouped int4 matmul (`aten._weight_int4pack_mm`, bf16, CUDA).

    `qdata` is the weight packed to tinygemm's 4-d tiles from [out_padded, in_padded] (in padded
    to a multiple of 1024, as torchao packs it); `scale_and_zero` [in_padded / group, out_padded,
    2] bf16.
    """

    def __init__(self, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group: int,
                 shape: tuple[int, int], bias: torch.Tensor | None) -> None:  # fmt: skip
        super().__init__()
        self.out_features, self.in_features = shape
        self.in_padded = scale_and_zero.shape[0] * group
        self.group = group
        self.qdata = _frozen(qdata.contiguous())
        self.scale_and_zero = _frozen(scale_and_zero.contiguous())
        self.bias = None if bias is None else _frozen(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.to(torch.bfloat16)
        if self.in_padded != self.in_features:
            a = F.pad(a, (0, self.in_padded - self.in_features))
        y = torch.ops.aten._weight_int4pack_mm(a, self.qdata, self.group, self.scale_and_zero)
        y = y[:, : self.out_features].to(x.dtype)
        return y if self.bias is None else y + self.bias
