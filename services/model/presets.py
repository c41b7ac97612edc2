"""Named random-weight models of production shape, for benchmarks.

`--model preset:NAME` materialises NAME once into .cache/presets/NAME: a real config.json of
its family, tokenizer, chat template and preprocessor config, but no weights, and a
RANDOM_WEIGHTS marker. The loader then initialises the modules directly on the target
device (no 13 GB file to write or read). Answers are noise, so benchmarks force the
output length; correctness is checked separately on real checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
PRESET_PREFIX = "preset:"
MARKER = "RANDOM_WEIGHTS"

# The fields a preset sets, in the order its numbers are written below.
VISION_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "image_size",
    "patch_size",
    "projection_dim",
)
TEXT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
)


def _preset(vision: tuple[int, ...], text: tuple[int, ...], family: str = "llava", **extra) -> dict:
    """A preset's config fields by part; `extra` holds a family's own parts (DeepSeek's high-res tower)."""
    return {
        "family": family,
        "vision": dict(zip(VISION_FIELDS, vision, strict=True)),
        "text": dict(zip(TEXT_FIELDS, text, strict=True)),
        **extra,
    }


PRESETS: dict[str, dict] = {
    # CLIP ViT-L/14 @ 336 (576 image tokens), 2-layer MLP projector 1024 -> 4096,
    # Llama-2-7B shape (32 layers, 4096 wide, 11008 MLP, 32 heads).
    "llava-7b-shaped": _preset((1024, 4096, 24, 16, 336, 14, 768), (4096, 11008, 32, 32, 32, 32000, 4096)),
    # The same structure at toy size, for tests on the CPU.
    "tiny-shaped": _preset((64, 128, 3, 4, 56, 14, 64), (64, 128, 2, 4, 4, 512, 512)),
    # deepseek-vl-7b-chat: SigLIP-L/16 @ 384 (576 tokens, exact GELU) beside a SAM ViT-B/16 @ 1024,
    # fused by the hybrid aligner; Llama decoder of 30 layers, 4096 wide, vocabulary 102400.
    "deepseek-vl-7b-shaped": _preset(
        (1024, 4096, 24, 16, 384, 16, 1024),
        (4096, 11008, 30, 32, 32, 102400, 16384),
        family="deepseek_vl_hybrid",
        high_res={
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "image_size": 1024,
            "patch_size": 16,
        },
    ),
    # Qwen2.5-VL-7B-Instruct: a 32-layer ViT (1280 wide, 14-px patches, windows of 112 px, full
    # attention in layers 7, 15, 23, 31), the 2x2 merger to 3584; Qwen2-7B (28 layers, 28 heads,
    # 4 KV heads, vocabulary 152064) with M-RoPE (16, 24, 24). Pictures up to 28*28*1280 px
    # (1280 tokens, the size the model card suggests for serving), not the processor's 16384.
    "qwen2.5-vl-7b-shaped": {
        "family": "qwen2_5_vl",
        "vision": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "out_hidden_size": 3584,
        },
        "text": {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        },
        "max_pixels": 28 * 28 * 1280,
    },
}


def resolve_model(model: str, cache: Path | None = None) -> str:
    """A checkpoint directory for `model`: itself, or a preset materialised on first use."""
    if not model.startswith(PRESET_PREFIX):
        return model
    name = model[len(PRESET_PREFIX) :]
    if name not in PRESETS:
        from services.common.errors import InvalidArgument

        raise InvalidArgument(f"unknown preset {name!r}: use one of {', '.join(PRESETS)}")
    out = (cache or ROOT / ".cache" / "presets") / name
    if not (out / MARKER).is_file():
        _materialize(name, out)
    return str(out)


def _materialize(name: str, out: Path) -> None:
    from services.model.family import family_named

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    family_named(PRESETS[name]["family"]).write_preset(tmp, name)
    (tmp / MARKER).write_text(json.dumps({"preset": name, "seed": 0}))
    if out.exists():  # another process won the race; keep theirs
        shutil.rmtree(tmp)
        return
    os.rename(tmp, out)


def is_random(model_dir: Path) -> bool:
    return (model_dir / MARKER).is_file()


@torch.no_grad()
def init_random(module: nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Materialise a meta-device module on `device` with GPT-style random weights."""
    module = module.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:  # norms and the CLS embedding
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return module.to(dtype=dtype).eval().requires_grad_(False)
