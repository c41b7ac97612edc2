"""The batch-1 decode step's matmuls: y = x W^T for one row x, in one Triton kernel that reads W
once, front to back, with no split over K.

A decode step reads every weight once, so its linears are bound by memory bandwidth. At one row
cuBLAS picks split-K kernels for the narrow projections (o and down), each followed by a reduce
kernel, and reads them below the bandwidth it reaches on the wide ones. Here each program owns
`block_n` rows of W and streams them whole, keeping partial products per column and summing
them once at the end: one pass, nothing to reduce after it (docs/PERF.md).

Only one row: from 2 rows up cuBLAS's tensor-core kernels stay, since a multi-row tile of this
kernel is slower than them inside the decode step (docs/PERF.md).

`linear` is F.linear's drop-in: the kernel where it applies (CUDA, one row, a plain 2-D weight
of the input's dtype, bf16, fp16 or fp32, no bias), F.linear otherwise (the CPU, a batch, a
prefill). Quantized projections never come here: they run their own kernels
(services/model/qlinear.py). The decode step passes it to the model's layers
(services/llm/attention.py). Configs per shape: `python -m bench.gemv`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only host: F.linear everywhere
    triton = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Config(NamedTuple):
    block_n: int  # rows of W per program
    block_k: int  # columns per load
    warps: int
    stages: int


def pick(n: int, k: int, element_size: int = 2) -> Config:
    """The kernel config for W [n, k].

    From `python -m bench.gemv` (docs/PERF.md), 16-bit weights: outputs up to 8192
    wide (o, down) want few rows of W per program and long loads, so that 4096 outputs still make
    256 programs; wide outputs (q/k/v, gate/up) twice the rows and shorter loads. 32-bit weights
    load half as many columns (the same bytes a stage: shared memory would not hold more).
    """
    cfg = Config(16, 1024, 8, 4) if n <= 8192 else Config(32, 256, 8, 3)
    block_k = cfg.block_k if element_size <= 2 else cfg.block_k // 2
    return cfg._replace(block_k=max(16, min(block_k, triton.next_power_of_2(k))))


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` runs the kernel for these operands (else it is F.linear)."""
    return (
        triton is not None
        and bias is None
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and type(weight) in (torch.Tensor, torch.nn.Parameter)  # not a tensor subclass
        and weight.dim() == 2
        and weight.dtype == x.dtype
        and x.dtype in _DTYPES
        and weight.stride(1) == 1
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [M, K], weight [N, K] -> [M, N]; the kernel where it applies."""
    if applies(x, weight, bias):
        return _one_row_linear(x, weight)
    return F.linear(x, weight, bias)


if triton is not None:

    @triton.jit
    def _one_row(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xk, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
        # y[n] = sum_k w[n, k] x[k] (times s[n] if SCALED: a 1-byte weight's per-channel scale):
        # partial products kept per column, summed once at the end.
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + rk
            w_mask = (rn[:, None] < N) & (ks[None, :] < K)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + ks[None, :], mask=w_mask, other=0.0)
            x = tl.load(x_ptr + ks * stride_xk, mask=ks < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if SCALED:
            y *= tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: Config, launcher=None, scale=None) -> None:
    """y [1, N] = x [1, K] w[N, K]^T with this config (`launcher` wraps the kernel: torch.compile's);
    `scale` [N] fp32 multiplies each output (w of 1 byte, int8 or fp8: services/model/int8_mm.py)."""
    n, k = w.shape
    run = launcher or (lambda kernel: kernel)
    grid = (triton.cdiv(n, cfg.block_n),)
    opts = {"BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "num_warps": cfg.warps, "num_stages": cfg.stages}
    s = scale if scale is not None else y  # unread unless SCALED
    run(_one_row)[grid](x, w, s, y, n, k, x.stride(1), w.stride(0), SCALED=scale is not None, **opts)


if triton is not None:
    # Registered at import, not on first use: Dynamo traces into a cached factory rather than
    # through its result, and breaks the graph at the registration.
    @torch.library.triton_op("vlmesh::one_row_linear", mutates_args=())
    def _one_row_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The kernel as a torch op, so torch.compile traces it into its graph."""
        y = torch.empty(1, w.shape[0], device=x.device, dtype=x.dtype)
        launch(x, w, y, pick(w.shape[0], w.shape[1], x.element_size()), torch.library.wrap_triton)
        return y
