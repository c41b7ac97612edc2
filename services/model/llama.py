"""Llama-family decoder in plain PyTorch, token-major, with attention left to the caller.

Shapes: N tokens (of one or many sequences, packed), H hidden, h heads, g kv heads, d head
dim, V vocab. The model holds no KV cache: a layer is `attn_in` (norm, QKV, RoPE: the
queries, keys and values) and `attn_out` (output projection, residuals, MLP), and the
caller runs the attention between them over wherever it keeps K/V (the llm engine's paged
pool). Compilation and graph capture are applied from outside (services/llm/).

Module names mirror the Hugging Face checkpoint so state dicts load by name;
`fuse_projections` then concatenates q/k/v and gate/up into one matrix each (fewer, larger
matmuls: the decode step is bound by reading weights, and one read of a wider matrix
beats three launches of narrow ones). The forward runs on fused projections only: the
loader fuses unless asked not to (the vLLM engine exports the unfused weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model.fuse import fuse_linears
from services.model.qlinear import project
from services.model.spec import ModelSpec, TextSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, as the reference does, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_context, d] for the checkpoint's RoPE type, computed in fp32 then cast.

    A position's row is what transformers computes for it, so gathering rows by position
    gives the same values as computing them per step.
    """
    t = spec.text
    if t.rope_type == "default":
        exponent = torch.arange(0, t.head_dim, 2, dtype=torch.int64, device=device).float() / t.head_dim
        inv_freq, scaling = 1.0 / (t.rope_theta**exponent), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[t.rope_type](spec.hf_config.text_config, device)
        inv_freq, scaling = inv_freq.float(), float(scaling)
    positions = torch.arange(t.max_context, device=device).float()
    freqs = positions[:, None] * inv_freq  # [S, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rope_rows(
    rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, columns: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, d] of `positions`: [N] (one position a token), or [N, 3] with `columns`
    (services/model/mrope.py): channel j of token n turns by component columns[j] of its position."""
    if positions.dim() == 1:
        return rope[0][positions], rope[1][positions]
    index = positions[:, columns]  # [N, d]: the position each channel turns by
    return rope[0].gather(0, index), rope[1].gather(0, index)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d], cos/sin [N, d] -> x rotated (the half-split convention of Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, t: TextSpec) -> None:
        super().__init__()
        self.h, self.g, self.d = t.heads, t.kv_heads, t.head_dim
        self.q_proj = nn.Linear(t.hidden, t.heads * t.head_dim, bias=t.qkv_bias)
        self.k_proj = nn.Linear(t.hidden, t.kv_heads * t.head_dim, bias=t.qkv_bias)
        self.v_proj = nn.Linear(t.hidden, t.kv_heads * t.head_dim, bias=t.qkv_bias)
        self.o_proj = nn.Linear(t.heads * t.head_dim, t.hidden, bias=False)

    def fuse(self) -> None:
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, linear=F.linear):
        """x [N, H] -> q [N, h, d], k [N, g, d] (both rotated), v [N, g, d]."""
        n = x.shape[0]
        q, k, v = project(x, self.qkv_proj, linear).split([self.h * self.d, self.g * self.d, self.g * self.d], dim=-1)
        q = apply_rope(q.view(n, self.h, self.d), cos, sin)
        k = apply_rope(k.view(n, self.g, self.d), cos, sin)
        return q, k, v.view(n, self.g, self.d)


class MLP(nn.Module):
    def __init__(self, t: TextSpec) -> None:
        super().__init__()
        self.intermediate = t.intermediate
        self.gate_proj = nn.Linear(t.hidden, t.intermediate, bias=False)
        self.up_proj = nn.Linear(t.hidden, t.intermediate, bias=False)
        self.down_proj = nn.Linear(t.intermediate, t.hidden, bias=False)

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, linear=F.linear) -> torch.Tensor:
        gate, up = project(x, self.gate_up_proj, linear).split(self.intermediate, dim=-1)
        return project(F.silu(gate) * up, self.down_proj, linear)


class DecoderLayer(nn.Module):
    def __init__(self, t: TextSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(t.hidden, t.eps)
        self.self_attn = Attention(t)
        self.post_attention_layernorm = RMSNorm(t.hidden, t.eps)
        self.mlp = MLP(t)

    def attn_in(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, linear=F.linear):
        """The residual stream x [N, H] -> q, k, v for this layer's attention.

        `linear` computes the plain projections, F.linear's signature (the decode step passes
        services/model/gemv.py's); quantized ones run their own (services/model/qlinear.py)."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin, linear)

    def attn_out(self, x: torch.Tensor, o: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """x [N, H] and the attention output o [N, h, d] -> the layer's output [N, H]."""
        x = x + project(o.flatten(1), self.self_attn.o_proj, linear)
        return x + self.mlp(self.post_attention_layernorm(x), linear)


class LlamaDecoder(nn.Module):
    """Token embeddings (`embed_tokens`), the layers, and `logits`: the final norm and the head."""

    def __init__(self, t: TextSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(t.vocab, t.hidden)
        self.layers = nn.ModuleList(DecoderLayer(t) for _ in range(t.layers))
        self.norm = RMSNorm(t.hidden, t.eps)
        self.lm_head = nn.Linear(t.hidden, t.vocab, bias=False)

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Concatenate q/k/v and gate/up weights (after loading: checkpoints keep them apart)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> next-token logits [n, V] in fp32."""
        return self.lm_head(self.norm(hidden)).float()
