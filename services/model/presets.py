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


def _preset(vision: tuple[int, ...], text: tuple[int, ...]) -> dict[str, dict[str, int]]:
    return {
        "vision": dict(zip(VISION_FIELDS, vision, strict=True)),
        "text": dict(zip(TEXT_FIELDS, text, strict=True)),
    }


PRESETS: dict[str, dict[str, dict[str, int]]] = {
    # CLIP ViT-L/14 @ 336 (576 image tokens), 2-layer MLP projector 1024 -> 4096,
    # Llama-2-7B shape (32 layers, 4096 wide, 11008 MLP, 32 heads).
    "llava-7b-shaped": _preset((1024, 4096, 24, 16, 336, 14, 768), (4096, 11008, 32, 32, 32, 32000, 4096)),
    # The same structure at toy size, for tests on the CPU.
    "tiny-shaped": _preset((64, 128, 3, 4, 56, 14, 64), (64, 128, 2, 4, 4, 512, 512)),
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
