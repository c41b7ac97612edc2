"""The decoder's quantized projections, as modules of plain tensors: weight-only int8 and int4, and
fp8 (e4m3 weights; fp8 activations for prompt rows).

torchao quantizes the int8 and int4 weights (services/model/quantize.py); these modules then hold its data
as ordinary parameters and call the matmul its tensor subclass would dispatch to. Why not keep
the subclass: torch.compile traces through a tensor subclass's dispatch on every compile, which
makes an engine of many captured graphs slow to warm up; plain tensors compile as fast as bf16
(docs/PERF.md).

`project(x, layer, linear)` is how the model calls any projection: a plain nn.Linear through
`linear` (F.linear's signature: the decode step passes services/model/gemv.py's), a quantized
one through its own kernel.
"""

from __future__ import annotations

import functools
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


def _rows(forward: Callable) -> Callable:
    """A projection's forward on x [..., in] as rows [N, in] (the engine's own x is 2-D already;
    transformers' [batch, positions, in] too, where bench.quant_agreement puts these layers)."""

    @functools.wraps(forward)
    def on_rows(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return forward(self, x)
        y = forward(self, x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return on_rows


# Rows up to which an int8 projection on CUDA runs services/model/int8_mm.py's kernel. Decode-sized
# rows are bound by reading the weight, where the kernel's 1 byte a weight wins; prompt-sized rows
# are bound by compute, where cuBLAS feeds the tensor cores faster (docs/PERF.md). More rows
# convert the weight to bf16 (exact: |q| <= 127) and run cuBLAS, the per-channel scale applied to
# the product; inductor fuses the conversion where the layer is compiled. The packed prefill's
# smallest row bucket is 128, a decode batch at most 32: rows between are rare, and either side
# serves them.
INT8_KERNEL_ROWS = 64


class Int8Linear(nn.Module):
    """y = (x Q^T) s (+ b): Q [out, in] int8, s [out] fp32, one scale per output channel.

    On CUDA in bf16/fp16 up to INT8_KERNEL_ROWS rows: the int8 kernel; otherwise (prompt rows, the
    CPU, fp32) torchao's weight-only math, the weight converted to x's dtype and cuBLAS.
    """

    def __init__(self, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.qdata = _frozen(q.contiguous())
        self.scale = _frozen(s.reshape(-1).float().contiguous())
        self.bias = None if bias is None else _frozen(bias)

    @_rows
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if int8_mm.applies(x) and x.shape[0] <= INT8_KERNEL_ROWS:
            y = int8_mm.linear(x, self.qdata, self.scale)
        else:  # the scale in fp32 on the product, as the kernel applies it
            y = (F.linear(x, self.qdata.to(x.dtype)).float() * self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias


# Rows up to which an int4 projection runs tinygemm, a small-batch kernel that beats bf16 at a few
# rows and falls far behind it as rows grow. More rows dequantize the weight to bf16 from its
# unpacked codes (read 0.5 bytes a weight, write 2) and run cuBLAS (docs/PERF.md).
INT4_TINYGEMM_ROWS = 16


class Int4Linear(nn.Module):
    """Grouped int4 weights: tinygemm's matmul (`aten._weight_int4pack_mm`, bf16, CUDA) for up to
    INT4_TINYGEMM_ROWS rows, a dequantized bf16 weight and cuBLAS for more.

    `qdata` is the weight packed to tinygemm's 4-d tiles from [out_padded, in_padded] (in padded
    to a multiple of 1024, as torchao packs it); `scale_and_zero` [in_padded / group, out_padded,
    2] bf16. `nibbles` [out, in_padded / 2] uint8 holds the same 4-bit codes two a byte (see
    int4_codes), for the dequantizing path: tinygemm's tiles cannot be unpacked by tensor ops. It
    is a buffer, not a parameter: a decode step reads only the tiles, and weight_bytes counts what
    a step reads; it costs another 0.5 bytes a weight of memory.
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
        # tinygemm's own dequantization: the identity through its matmul gives W^T [in_padded,
        # out_padded] as the kernel sees it (once, at load).
        eye = torch.eye(self.in_padded, device=qdata.device, dtype=torch.bfloat16)
        dense = torch.ops.aten._weight_int4pack_mm(eye, self.qdata, group, self.scale_and_zero)
        sz = self.scale_and_zero[:, : self.out_features]
        self.register_buffer("nibbles", int4_codes(dense[:, : self.out_features].t(), sz, group), persistent=False)

    @_rows
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.to(torch.bfloat16)
        if self.in_padded != self.in_features:
            a = F.pad(a, (0, self.in_padded - self.in_features))
        if a.shape[0] <= INT4_TINYGEMM_ROWS:
            y = torch.ops.aten._weight_int4pack_mm(a, self.qdata, self.group, self.scale_and_zero)
            y = y[:, : self.out_features]
        else:
            sz = self.scale_and_zero[:, : self.out_features]
            y = F.linear(a, int4_dequantize(self.nibbles, sz, self.group))
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


def _scale_zero(scale_and_zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[groups, out, 2] -> scale, zero as [out, groups, 1] fp32 (broadcast over a group's inputs)."""
    sz = scale_and_zero.float().transpose(0, 1)
    return sz[..., 0:1], sz[..., 1:2]


def int4_codes(dense: torch.Tensor, scale_and_zero: torch.Tensor, group: int) -> torch.Tensor:
    """The 4-bit codes of a dequantized weight dense [out, in] -> [out, in / 2] uint8, input
    channel 2i in the high nibble and 2i+1 in the low one (torchao's order before tinygemm's tiles).

    tinygemm's scheme: w = (q - 8) * scale + zero, per group of `group` inputs, q in 0..15; so
    q = round((w - zero) / scale) + 8. A zero scale (a constant group) gives q = 8.
    """
    out, k = dense.shape
    scale, zero = _scale_zero(scale_and_zero)
    w = dense.float().reshape(out, k // group, group)
    q = torch.where(scale == 0, 0.0, (w - zero) / scale).round() + 8
    q = q.clamp(0, 15).to(torch.uint8).reshape(out, k // 2, 2)
    return q[..., 0] << 4 | q[..., 1]


def int4_dequantize(nibbles: torch.Tensor, scale_and_zero: torch.Tensor, group: int) -> torch.Tensor:
    """nibbles [out, in / 2] uint8 (int4_codes' layout), scale_and_zero [in / group, out, 2] ->
    the weight [out, in] in bf16."""
    out = nibbles.shape[0]
    q = torch.stack((nibbles >> 4, nibbles & 15), dim=-1).view(out, -1, group).float()  # [out, groups, group]
    scale, zero = _scale_zero(scale_and_zero)
    return ((q - 8) * scale + zero).reshape(out, -1).to(torch.bfloat16)


# fp8 e4m3 (Hopper's and Ada's fp8 tensor cores): 3 mantissa bits, largest finite value 448.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Rows up to which an fp8 projection reads its weight through int8_mm's kernel (bf16 activations,
# the weight converted in registers): decode rows, bound by the weight's bytes. More rows (prompt
# steps, bound by compute) quantize the activations per row and run an fp8 GEMM at the fp8 tensor
# cores' rate. The same split as int8's (INT8_KERNEL_ROWS).
FP8_KERNEL_ROWS = INT8_KERNEL_ROWS


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], scale [M, 1] fp32) with x ~ q * scale: each row's largest magnitude
    at 448 (symmetric, one scale a row: per output channel for a weight, per token for activations).
    An all-zero row gets scale 1 (its codes are 0)."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """y = x W^T (+ b), W stored as e4m3 Q [out, in] and s [out] fp32 (W ~ Q s, per output channel).

    On CUDA (bf16, compute capability 8.9+): up to FP8_KERNEL_ROWS rows int8_mm's kernel reads Q as
    1 byte a weight (W8A16); more rows quantize x per row to e4m3 and run `torch._scaled_mm` with
    row-wise scales (W8A8, fp32 accumulation, bf16 out), the quantization fused into the prompt
    step's compiled graph. Elsewhere (the CPU, where tests run it) the same arithmetic emulated in
    fp32: the rows' codes and scales are those the GPU path makes, the products summed in fp32.
    """

    def __init__(self, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.qdata = _frozen(q.contiguous())
        self.scale = _frozen(s.reshape(-1).float().contiguous())
        self.bias = None if bias is None else _frozen(bias)

    @classmethod
    @torch.no_grad()
    def of(cls, linear: nn.Linear) -> Fp8Linear:
        """The fp8 projection of a full-precision one: per-output-channel scales from its weight."""
        q, s = fp8_rows(linear.weight)
        return cls(q, s, linear.bias)

    @_rows
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= FP8_KERNEL_ROWS:
            if int8_mm.applies(x):
                y = int8_mm.linear(x, self.qdata, self.scale)
            else:  # W8A16, emulated: the weight dequantized, fp32 products
                y = (F.linear(x.float(), self.qdata.float()) * self.scale).to(x.dtype)
        else:
            xq, xs = fp8_rows(x)
            if x.is_cuda and x.dtype == torch.bfloat16:
                y = torch._scaled_mm(xq, self.qdata.t(), scale_a=xs, scale_b=self.scale.view(1, -1), out_dtype=x.dtype)
            else:  # W8A8, emulated
                y = ((F.linear(xq.float(), self.qdata.float()) * xs) * self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias
