"""y = (x Q^T) * s: a bf16/fp16 activation times a 1-byte weight (int8, or fp8 e4m3) with one scale
per output channel, in one Triton kernel that reads the weight as stored.

Weight-only int8 exists to halve the bytes a decode step reads. torchao's int8 weight-only
linear computes `mm(x, Q.t().to(x.dtype)) * s`: on the GPU that is a kernel writing the whole
weight back in bf16 and cuBLAS reading it, 5 bytes a weight per step against bf16's 2. Here
each program converts its tile of Q in registers and feeds the tensor cores, so a step reads
1 byte a weight (plus the scales). `Q` and `s` are torchao's own (services/model/quantize.py
unwraps them), so the numbers are its scheme's: symmetric, per output channel. The fp8 variant's
decode rows run the same kernel over e4m3 weights (services/model/qlinear.py's Fp8Linear): the
tile converts to x's dtype in registers either way.

The kernel is a torch custom op, opaque to torch.compile: it picks its tile sizes from the row
count at run time, so a prefill compiled for any token count does not guard on it, and CUDA
graphs capture it like any kernel. Configs: `python -m bench.int8_mm` (docs/PERF.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.model import gemv

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only host: the dequantizing F.linear everywhere
    triton = None


class Config(NamedTuple):
    block_m: int  # rows of x per program (the tensor cores' tile: 16 at least)
    block_n: int  # output channels per program
    block_k: int  # input channels per load
    warps: int
    stages: int
    split_k: int = 1  # programs along K, each a share of it, their partial sums added by a second kernel


# One row: gemv's streaming kernel, scaled, with 8 channels a program (512 programs for 4096).
# int8: it beats any tensor-core tile up to 8192 output channels (o, down), the 16-row tile
# beats it on wider ones. e4m3: it wins on every 7B shape, the widest (gate/up) with shorter
# loads (docs/PERF.md).
ONE_ROW = gemv.Config(8, 1024, 4, 4)
ONE_ROW_FP8 = gemv.Config(8, 1024, 4, 3)
ONE_ROW_FP8_WIDE = gemv.Config(8, 512, 4, 3)


def one_row(n: int, fp8: bool) -> gemv.Config | None:
    """gemv's config for one row times Q [n, K]^T, or None where the 16-row tile serves it better."""
    if fp8:
        return ONE_ROW_FP8_WIDE if n > 16384 else ONE_ROW_FP8
    return ONE_ROW if n <= 8192 else None


def pick(m: int, n: int, fp8: bool = False) -> Config:
    """The tile for x [m, K] times Q [n, K]^T (m > 1; one row: `one_row`), Q int8 or e4m3.

    From `python -m bench.int8_mm [--weight fp8]` (docs/PERF.md), the 7B shapes. Decode-sized
    rows are bound by reading Q: narrow tiles of output channels, so that even 4096 channels make
    128 programs, and long loads along K; the widest (gate/up) twice the channels. Prefill-sized
    rows are bound by compute: square tiles that reuse each loaded tile of Q across 128 rows.
    e4m3's best decode tiles differ (H100): from 16 to 32 rows, channels in 64s with K split
    across programs (o, down; q/k/v at 32), gate/up's longer loads unsplit.
    """
    wide = n > 16384
    if fp8 and m <= 16:
        if n <= 8192:  # o, down: K split in 4, as at 32 rows
            return Config(16, 64, 128, 4, 4, 4)
        return Config(16, 64, 128, 8, 4) if wide else Config(16, 32, 256, 4, 4)
    if fp8 and m <= 32:
        # K split in 4 (2 for q/k/v): 4096 outputs in 64s make only 64 programs for 132 SMs.
        return Config(32, 64, 256, 4, 3) if wide else Config(32, 64, 128, 4, 4, 2 if n > 8192 else 4)
    if m <= 16:
        return Config(16, 64 if wide else 32, 256, 4, 4)
    if m <= 64:
        return Config(32 if m <= 32 else 64, 64 if wide else 32, 128 if wide else 256, 4, 4)
    return Config(128, 128, 64, 4, 4)


def applies(x: torch.Tensor) -> bool:
    """Whether `linear` runs the kernel for this input (else it dequantizes and runs F.linear)."""
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16, CUDA), q [N, K] int8 or float8_e4m3fn, s [N] fp32 -> [M, N] in x's dtype."""
    return _byte_weight_linear(x, q, s)


if triton is not None:

    @triton.jit
    def _kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ym, k_share,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        # Split along K (grid axis 2 > 1): program (n, m, j) sums the j-th `k_share` input channels into
        # y_ptr, an fp32 workspace [split, M, N] whose row stride is stride_ym; `_add_shares` adds them.
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        k_start = tl.program_id(2) * k_share
        k_end = tl.minimum(k_start + k_share, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + rk
            x_mask = (rm[:, None] < M) & (ks[None, :] < k_end)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
            # Q's tile transposed, [BLOCK_K, BLOCK_N]: contiguous along K, as stored.
            w_mask = (rn[None, :] < N) & (ks[:, None] < k_end)
            w = tl.load(q_ptr + rn[None, :] * stride_qn + ks[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(x, w.to(x.dtype), acc)
        s = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
        y = acc * s[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        out = y_ptr + tl.program_id(2) * M * stride_ym + rm[:, None] * stride_ym + rn[None, :]
        tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_shares(ws_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """y [M, N] = the sum of the workspace's SPLIT shares [SPLIT, M, N] (fp32), in y's dtype."""
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(SPLIT):
            acc += tl.load(ws_ptr + j * MN + r, mask=r < MN, other=0.0)
        tl.store(y_ptr + r, acc.to(y_ptr.dtype.element_ty), mask=r < MN)


def launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, y: torch.Tensor, cfg: Config) -> None:
    """y [M, N] = (x [M, K] q [N, K]^T) * s [N], with this config (y contiguous)."""
    m, k = x.shape
    n = q.shape[0]
    split = cfg.split_k
    assert split == 1 or (y.is_contiguous() and split * m * n < 2**31), "a split launch: y contiguous, int32 offsets"
    share = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k  # whole loads per share
    out = y if split == 1 else torch.empty(split, m, n, device=y.device, dtype=torch.float32)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    _kernel[grid](x, q, s, out, m, n, k, x.stride(0), q.stride(0), n if split > 1 else y.stride(0), share,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  num_warps=cfg.warps, num_stages=cfg.stages)  # fmt: skip
    if split > 1:
        _add_shares[(triton.cdiv(m * n, 1024),)](out, y, m * n, SPLIT=split, BLOCK=1024)


# Registered at import, not on first use: Dynamo does not trace through a cached factory's
# result but into the factory, and breaks the graph at the registration (four breaks a layer,
# five graphs to compile per decode bucket).
@torch.library.custom_op("vlmesh::byte_weight_linear", mutates_args=())
def _byte_weight_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The kernel as a custom op: opaque to torch.compile, so its tile choice by row count is
    made at run time, not guarded on in a compiled graph."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], q.shape[0], device=x.device, dtype=x.dtype)
    fp8 = q.dtype == torch.float8_e4m3fn
    row = one_row(q.shape[0], fp8) if x.shape[0] == 1 else None
    if row is not None:
        gemv.launch(x, q, y, row, scale=s)
    elif x.shape[0]:
        launch(x, q, s, y, pick(x.shape[0], q.shape[0], fp8))
    return y


@_byte_weight_linear.register_fake
def _(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])
