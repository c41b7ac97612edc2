"""Llama-family decoder in plain PyTorch with a slot-indexed KV cache.

Shapes: B sequences, T new tokens, S cache positions, H hidden, h heads, g kv heads,
d head dim. The cache holds one row per engine slot; a sequence owns its slot from
prefill to finish, which is what lets requests join and leave the batch at any step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model.spec import LlavaSpec, TextSpec


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


def rope_inv_freq(spec: LlavaSpec, device: torch.device) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [d/2] and attention scaling for the checkpoint's RoPE type."""
    t = spec.text
    if t.rope_type == "default":
        exponent = torch.arange(0, t.head_dim, 2, dtype=torch.int64, device=device).float() / t.head_dim
        return 1.0 / (t.rope_theta**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[t.rope_type](spec.hf_config.text_config, device)
    return inv_freq.float(), float(scaling)


def rope_cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, 1, T, d] (broadcast over heads)."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scaling).to(dtype)[:, None], (emb.sin() * scaling).to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, t: TextSpec) -> None:
        super().__init__()
        self.h, self.g, self.d = t.heads, t.kv_heads, t.head_dim
        self.q_proj = nn.Linear(t.hidden, t.heads * t.head_dim, bias=False)
        self.k_proj = nn.Linear(t.hidden, t.kv_heads * t.head_dim, bias=False)
        self.v_proj = nn.Linear(t.hidden, t.kv_heads * t.head_dim, bias=False)
        self.o_proj = nn.Linear(t.heads * t.head_dim, t.hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, 1, T, d]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [slots, g, S, d]
        v_cache: torch.Tensor,
        slots: torch.Tensor,  # [B] cache rows
        positions: torch.Tensor,  # [B, T]
        kv_len: int,  # attend to cache positions [0, kv_len)
        mask: torch.Tensor | None,  # [B, 1, T, kv_len] bool, True = attend; None = causal
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)  # [B, h, T, d]
        k = self.k_proj(x).view(b, t, self.g, self.d).transpose(1, 2)  # [B, g, T, d]
        v = self.v_proj(x).view(b, t, self.g, self.d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Scatter the new keys/values into each sequence's cache row at its positions.
        rows = slots[:, None].expand(b, t)
        k_cache[rows, :, positions] = k.transpose(1, 2)
        v_cache[rows, :, positions] = v.transpose(1, 2)
        keys = k_cache[slots, :, :kv_len]  # [B, g, kv_len, d]
        values = v_cache[slots, :, :kv_len]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=self.g != self.h
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, t: TextSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(t.hidden, t.intermediate, bias=False)
        self.up_proj = nn.Linear(t.hidden, t.intermediate, bias=False)
        self.down_proj = nn.Linear(t.intermediate, t.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, t: TextSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(t.hidden, t.eps)
        self.self_attn = Attention(t)
        self.post_attention_layernorm = RMSNorm(t.hidden, t.eps)
        self.mlp = MLP(t)


class LlamaDecoder(nn.Module):
    """Token embeddings in, next-token logits out, reading and writing the KV cache."""

    def __init__(self, t: TextSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(t.vocab, t.hidden)
        self.layers = nn.ModuleList(DecoderLayer(t) for _ in range(t.layers))
        self.norm = RMSNorm(t.hidden, t.eps)
        self.lm_head = nn.Linear(t.hidden, t.vocab, bias=False)

    def forward(
        self,
        embeds: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [layers, slots, g, S, d]
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        kv_len: int,
        mask: torch.Tensor | None,
        last_only: torch.Tensor,  # [B] index of the token whose logits are wanted
    ) -> torch.Tensor:
        x = embeds
        for i, layer in enumerate(self.layers):
            x = x + layer.self_attn(
                layer.input_layernorm(x), cos, sin, k_cache[i], v_cache[i], slots, positions, kv_len, mask
            )
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = x[torch.arange(x.shape[0], device=x.device), last_only]  # [B, H]
        return self.lm_head(self.norm(x)).float()  # [B, vocab]
