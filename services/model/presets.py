"""Named random-weight models of production shape, for benchmarks.

`--model preset:NAME` materialises NAME once into .cache/presets/NAME: a real LLaVA
config.json, tokenizer, chat template and preprocessor config, but no weights, and a
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

PRESETS: dict[str, dict] = {
    # CLIP ViT-L/14 @ 336 (576 image tokens), 2-layer MLP projector 1024 -> 4096,
    # Llama-2-7B shape (32 layers, 4096 wide, 11008 MLP, 32 heads).
    "llava-7b-shaped": {
        "vision": dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            image_size=336,
            patch_size=14,
            projection_dim=768,
        ),
        "text": dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
    },
    # The same structure at toy size, for tests on the CPU.
    "tiny-shaped": {
        "vision": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=56,
            patch_size=14,
            projection_dim=64,
        ),
        "text": dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=512,
            max_position_embeddings=512,
        ),
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
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig

    from services.model.tiny import build_tokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    preset = PRESETS[name]
    tok = build_tokenizer(tmp, vocab_size=1000)
    vision = CLIPVisionConfig(**preset["vision"])
    config = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(
            **preset["text"],
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=(vision.image_size // vision.patch_size) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    config.save_pretrained(tmp)
    side = vision.image_size
    CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(tmp)
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
