"""Qwen2.5-VL's vision transformer: pictures of any size packed along one axis, 2-D rotary
positions, attention within windows (the `fullatt_block_indexes` layers over each whole
picture), and the merger that folds each 2x2 block of patches into one token of the decoder's
width. Module names are transformers' (`visual.*`). The family around it (config, processor,
checkpoint) is services/model/qwen2_5_vl.py.
Shapes: N patches of all pictures packed, D = ViT width, P = C*T*p*p values a patch, H = text width.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from services.model.fuse import fuse_linears, pad_linear


class RMSNorm(nn.Module):
    """Qwen's RMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class PatchEmbed(nn.Module):
    """The Conv3d whose kernel is the whole patch: a matmul with its weight flattened."""

    def __init__(self, vc) -> None:
        super().__init__()
        p, t = vc.patch_size, vc.temporal_patch_size
        self.proj = nn.Conv3d(vc.in_channels, vc.hidden_size, kernel_size=(t, p, p), stride=(t, p, p), bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return patches.to(w.dtype) @ w.reshape(w.shape[0], -1).t()  # [N, P] -> [N, D]


# The MLP's hidden width is padded to a multiple of this (zero weights: silu(0) * 0 adds nothing).
# Qwen2.5-VL-7B's is 3,420: bf16 rows of 6,840 bytes, not 16-byte aligned, keep cuBLAS off its
# aligned kernels for gate, up and down, 60% of the tower's arithmetic.
ALIGN = 64


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.width = hidden
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    @torch.no_grad()
    def fuse(self) -> None:
        """gate and up as one matmul, the hidden width padded to ALIGN (after loading)."""
        width = -(-self.width // ALIGN) * ALIGN
        gate, up = (pad_linear(lin, out_features=width) for lin in (self.gate_proj, self.up_proj))
        self.gate_up_proj = fuse_linears(gate, up)
        self.down_proj = pad_linear(self.down_proj, in_features=width)
        self.width = width
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.width, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class Segments:
    """Runs of tokens that attend only among themselves: windows, or whole pictures."""

    bounds: tuple[int, ...]  # [cu[i], cu[i+1]) is segment i
    index: torch.Tensor  # [S, L] long: segment i's tokens, padded (with its last) to the longest, L
    valid: torch.Tensor  # [S, L] bool: which of them are its own
    rows: torch.Tensor  # [N] long: where each token sits in the flattened [S * L] (valid's places)

    @classmethod
    def of(cls, bounds: Sequence[int]) -> Segments:
        cu = torch.tensor(bounds)
        lengths = cu[1:] - cu[:-1]
        span = torch.arange(int(lengths.max()))
        valid = span[None] < lengths[:, None]
        index = torch.minimum(cu[:-1, None] + span[None], cu[1:, None] - 1)
        return cls(tuple(bounds), index, valid, valid.flatten().nonzero()[:, 0])

    def on(self, device: torch.device) -> Segments:
        return Segments(self.bounds, self.index.to(device), self.valid.to(device), self.rows.to(device))


# Up to this many segments run one SDPA each; more (the windows) run as one padded batch, keys
# past a segment's end masked. A picture's windows are many and alike in length, its full-
# attention segments few and of any length.
LOOP_SEGMENTS = 4


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Attention of each segment to itself alone. q, k, v [N, heads, hd] -> [N, heads, hd]."""
    if len(seg.bounds) - 1 <= LOOP_SEGMENTS:
        out = []
        for a, b in itertools.pairwise(seg.bounds):
            # [1, heads, len, hd]: SDPA's fused kernels take 4-D inputs only (3-D falls to math, in fp32)
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            out.append(F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1))
        return torch.cat(out)
    qs, ks, vs = (t[seg.index].transpose(1, 2) for t in (q, k, v))  # [S, heads, L, hd]
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.valid[:, None, None, :])
    # The segments' own rows, in order: [N, heads, hd]. A gather by index, not a boolean mask,
    # whose size the host would wait for (the tower runs in CUDA graphs).
    return o.transpose(1, 2).flatten(0, 1)[seg.rows]


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)


class VisionBlock(nn.Module):
    def __init__(self, vc) -> None:
        super().__init__()
        self.norm1 = RMSNorm(vc.hidden_size)
        self.norm2 = RMSNorm(vc.hidden_size)
        self.attn = VisionAttention(vc.hidden_size, vc.num_heads)
        self.mlp = MLP(vc.hidden_size, vc.intermediate_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments, fns: BlockFns
    ) -> torch.Tensor:
        q, k, v = fns.before(self, x, cos, sin)
        return fns.after(self, x, attend_segments(q, k, v, seg).flatten(1))


def before_attention(block: VisionBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """norm1, q/k/v and their rotary positions: x [N, D] -> q, k, v [N, heads, hd]. A function of
    the block, so one compiled graph serves every block (services/vision/graphs.py)."""
    n, attn = x.shape[0], block.attn
    q, k, v = attn.qkv(block.norm1(x)).reshape(n, 3, attn.heads, -1).unbind(1)
    cos, sin = cos[:, None], sin[:, None]  # [N, 1, hd], float32: the rotation runs in float32
    q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype)
    k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype)
    return q, k, v


def after_attention(block: VisionBlock, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The attention's projection and residual, then the MLP's: x, a [N, D] -> x [N, D]."""
    x = x + block.attn.proj(a)
    return x + block.mlp(block.norm2(x))


@dataclass(frozen=True)
class BlockFns:
    """How a block runs its work around the attention: eagerly, or compiled on CUDA (where each
    eager elementwise op is a kernel launch and a pass over memory)."""

    before: Callable = before_attention
    after: Callable = after_attention


EAGER = BlockFns()


def compiled_block_fns(backend: str | Callable = "inductor") -> BlockFns:
    """`BlockFns` compiled once for any number of patches: the rows (dim 0 of every tensor) are
    marked dynamic and the widths stay static, so the fused kernels index by constants. A
    224x224 picture's block is some forty kernels eager, most of them elementwise."""

    def rows_dynamic(fn: Callable) -> Callable:
        graph = torch.compile(fn, backend=backend)

        def call(block: VisionBlock, *tensors: torch.Tensor):
            for t in tensors:
                torch._dynamo.mark_dynamic(t, 0)
            return graph(block, *tensors)

        return call

    return BlockFns(rows_dynamic(before_attention), rows_dynamic(after_attention))


class PatchMerger(nn.Module):
    """Each 2x2 block of patches (adjacent in the packed order) -> one token of the decoder's width."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


@dataclass(frozen=True)
class Layout:
    """What the grids decide, computed once per set of grids on the host: each patch's (row, column)
    for the rotary positions, the window order of the merged units, and both attentions' segments."""

    rows_cols: torch.Tensor  # [N, 2] in the packed (merge) order
    window_index: torch.Tensor  # [N / m^2]: merged units in window order
    windows: Segments  # the windowed layers' segments, in window order
    pictures: Segments  # the full-attention layers' (one a picture)

    @property
    def n(self) -> int:
        return self.rows_cols.shape[0]


@dataclass(frozen=True)
class DeviceLayout:
    """A layout's tensors on the tower's device, and the rotary angles it gives: all a forward
    reads besides the patches, made before it runs (a CUDA graph replays these same tensors)."""

    order: torch.Tensor  # [N / m^2]: window_index
    inverse: torch.Tensor  # [N / m^2]: back to picture order
    cos: torch.Tensor  # [N, hd] float32, in window order
    sin: torch.Tensor
    windows: Segments
    pictures: Segments


@lru_cache(maxsize=256)
def layout(grids: tuple[tuple[int, int, int], ...], merge: int, window: int) -> Layout:
    """`window`: a window's side in merged units (window_size / merge / patch)."""
    rows_cols, window_index, cu_windows, cu_pictures, base = [], [], [0], [0], 0
    for t, h, w in grids:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        block = (h // merge, merge, w // merge, merge)
        rc = torch.stack([x.reshape(block).transpose(1, 2).flatten() for x in (rows, cols)], dim=-1)
        rows_cols.append(rc.repeat(t, 1))
        mh, mw = h // merge, w // merge
        index = torch.arange(t * mh * mw).reshape(t, mh, mw)
        pad_h, pad_w = window - mh % window, window - mw % window  # as transformers pads (a whole window when even)
        nh, nw = (mh + pad_h) // window, (mw + pad_w) // window
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1).reshape(t, nh, window, nw, window)
        padded = padded.permute(0, 1, 3, 2, 4).reshape(t, nh * nw, window * window)
        sizes = (padded >= 0).sum(-1).flatten()
        window_index.append(padded[padded >= 0] + base)
        for size in sizes.tolist():
            if size:
                cu_windows.append(cu_windows[-1] + size * merge * merge)
        cu_pictures.extend(cu_pictures[-1] + (i + 1) * h * w for i in range(t))
        base += t * mh * mw
    return Layout(torch.cat(rows_cols), torch.cat(window_index), Segments.of(cu_windows), Segments.of(cu_pictures))


class QwenVisionTower(nn.Module):
    """Packed patches [N, P] of pictures with grids [n, 3] -> their tokens [N / m^2, H], picture after picture.

    Module names are transformers' (`visual.*`), so the checkpoint loads as it is saved; then
    `fuse_projections`. Shapes vary with the pictures (`input_shapes` is None): on CUDA,
    services/vision/graphs.py captures a graph per batch of grids.
    """

    def __init__(self, vc) -> None:
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.window = vc.window_size // vc.spatial_merge_size // vc.patch_size
        self.full = frozenset(vc.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(vc)
        self.theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.spatial = vc.hidden_size // vc.num_heads // 2  # half the channels turn by the row, half by the column
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc.out_hidden_size, vc.hidden_size, vc.spatial_merge_size)

    def device_layout(self, grid: torch.Tensor, device: torch.device) -> DeviceLayout:
        """What `forward` reads for pictures of these grids [n, 3] (host), made on `device`."""
        lay = layout(tuple(tuple(g) for g in grid.tolist()), self.merge, self.window)
        unit, n = self.merge * self.merge, lay.n
        order = lay.window_index.to(device)
        # Computed here, not a buffer: the loader builds the module on meta and fills only weights.
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.spatial, 2, device=device).float() / self.spatial)
        freqs = lay.rows_cols.to(device)[..., None].float() * inv_freq  # [N, 2, hd/4]
        freqs = freqs.flatten(1).view(n // unit, unit, -1)[order].reshape(n, -1)  # [N, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        inverse = torch.argsort(lay.window_index).to(device)
        return DeviceLayout(order, inverse, emb.cos(), emb.sin(), lay.windows.on(device), lay.pictures.on(device))

    def forward(
        self, patches: torch.Tensor, grid: torch.Tensor, lay: DeviceLayout | None = None, fns: BlockFns = EAGER
    ) -> torch.Tensor:
        """`lay`: `device_layout(grid, ...)`, made beforehand (a CUDA graph's), else made here;
        `fns`: the blocks' work around their attention (compiled by services/vision/graphs.py)."""
        lay = lay or self.device_layout(grid, patches.device)
        unit = self.merge * self.merge
        x = self.patch_embed(patches)  # [N, D]
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[lay.order].reshape(n, -1)  # windows contiguous
        for i, block in enumerate(self.blocks):
            x = block(x, lay.cos, lay.sin, lay.pictures if i in self.full else lay.windows, fns)
        return self.merger(x)[lay.inverse]  # back to picture order

    def fuse_projections(self) -> None:
        """After loading: each block's MLP as its forward needs it (`MLP.fuse`)."""
        for block in self.blocks:
            block.mlp.fuse()

    def input_shapes(self) -> None:
        return None

    @property
    def patch_width(self) -> int:
        """One patch's values (3 x t x p x p)."""
        w = self.patch_embed.proj.weight
        return w[0].numel()

    def block_fns(self, compiled: bool) -> BlockFns:
        """The blocks' work around attention: eager, or compiled (`compiled_block_fns`)."""
        return compiled_block_fns() if compiled else EAGER

    def pictures(self, patches: torch.Tensor, grid: torch.Tensor, fns: BlockFns = EAGER) -> list[torch.Tensor]:
        """The tokens of each picture as its grid [rows, cols, H] (what the mesh hands on)."""
        return self.split(self(patches, grid, fns=fns), grid)

    def split(self, tokens: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        """The tower's output [N / m^2, H] for pictures of these grids -> one [rows, cols, H] each."""
        shapes = [(t * h // self.merge, w // self.merge) for t, h, w in grid.tolist()]
        return [x.view(r, c, -1) for x, (r, c) in zip(tokens.split([r * c for r, c in shapes]), shapes, strict=True)]
