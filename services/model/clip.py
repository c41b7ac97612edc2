"""CLIP vision transformer and the LLaVA projector, in plain PyTorch.

Module names mirror the Hugging Face checkpoint so state dicts load by name; the loader then
fuses each layer's q/k/v into one projection (`fuse_projections`), which the forward needs.
`forward` takes the function that runs a layer, so the vision service can compile one
(services/vision/graphs.py) while the layers stay plain modules.
Shapes: B images, P = patches (+1 CLS), D = vision width, H = text width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from services.model.family import LayerFn, run_layer
from services.model.fuse import fuse_linears
from services.model.spec import ModelSpec, VisionSpec


class VisionEmbeddings(nn.Module):
    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.patch_size = s.patch_size
        self.class_embedding = nn.Parameter(torch.empty(s.hidden))
        self.patch_embedding = nn.Conv2d(3, s.hidden, s.patch_size, s.patch_size, bias=False)
        self.position_embedding = nn.Embedding(s.patches + 1, s.hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # pixels [B, 3, S, S] -> patches [B, S/p * S/p, D]
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # [B, P, D]


class VisionAttention(nn.Module):
    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.heads = s.heads
        self.q_proj = nn.Linear(s.hidden, s.hidden)
        self.k_proj = nn.Linear(s.hidden, s.hidden)
        self.v_proj = nn.Linear(s.hidden, s.hidden)
        self.out_proj = nn.Linear(s.hidden, s.hidden)

    def fuse(self) -> None:
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, p, d = x.shape
        # [B, P, 3D] -> 3 x [B, heads, P, D/heads]
        q, k, v = self.qkv_proj(x).view(b, p, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, p, d))


class VisionMLP(nn.Module):
    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.fc1 = nn.Linear(s.hidden, s.intermediate)
        self.fc2 = nn.Linear(s.intermediate, s.hidden)
        self.act = ACT2FN[s.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(s.hidden, eps=s.eps)
        self.self_attn = VisionAttention(s)
        self.layer_norm2 = nn.LayerNorm(s.hidden, eps=s.eps)
        self.mlp = VisionMLP(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, s: VisionSpec) -> None:
        super().__init__()
        # Only the layers up to LLaVA's feature layer exist; later ones are never run.
        self.layers = nn.ModuleList(VisionLayer(s) for _ in range(s.layers_used))


class Projector(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.vision.projector_bias  # type: ignore[attr-defined]
        self.linear_1 = nn.Linear(spec.vision.vit.hidden, spec.text.hidden, bias=bias)  # type: ignore[attr-defined]
        self.act = ACT2FN[spec.vision.projector_act]  # type: ignore[attr-defined]
        self.linear_2 = nn.Linear(spec.text.hidden, spec.text.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionTower(nn.Module):
    """ViT + projector: pixels [B, 3, S, S] -> image features [B, image_tokens, H]."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        s: VisionSpec = spec.vision.vit  # type: ignore[attr-defined]
        self.image_size = s.image_size
        self.keep_cls = s.keep_cls
        self.embeddings = VisionEmbeddings(s)
        self.pre_layrnorm = nn.LayerNorm(s.hidden, eps=s.eps)
        self.encoder = VisionEncoder(s)
        self.multi_modal_projector = Projector(spec)

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Concatenate each layer's q/k/v weights (after loading: checkpoints keep them apart)."""
        for layer in self.encoder.layers:
            layer.self_attn.fuse()

    def input_shapes(self) -> list[tuple[int, ...]]:
        return [(3, self.image_size, self.image_size)]

    def forward(self, pixels: torch.Tensor, run_layer: LayerFn = run_layer) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))  # [B, P, D]
        for layer in self.encoder.layers:
            x = run_layer(layer, x)
        if not self.keep_cls:
            x = x[:, 1:]
        return self.multi_modal_projector(x)  # [B, image_tokens, H]
