"""What the services need to know of a LLaVA checkpoint, read from its config.json."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.errors import InvalidArgument


@dataclass(frozen=True)
class VisionSpec:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    image_size: int
    patch_size: int
    act: str
    eps: float
    # How many encoder layers to run: LLaVA reads hidden_states[feature_layer], so the
    # layers after it are skipped entirely.
    layers_used: int
    # Keep the CLS token ("full") or drop it ("default").
    keep_cls: bool

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_tokens(self) -> int:
        return self.patches + (1 if self.keep_cls else 0)


@dataclass(frozen=True)
class TextSpec:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_context: int
    rope_theta: float
    rope_type: str
    eps: float
    tie_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class LlavaSpec:
    model_dir: Path
    model_id: str
    vision: VisionSpec
    text: TextSpec
    image_token_id: int
    projector_act: str
    projector_bias: bool
    hf_config: object  # the transformers LlavaConfig, for rope set-up of non-default types

    @property
    def image_tokens(self) -> int:
        return self.vision.image_tokens


def _eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def load_spec(model_dir: str | Path) -> LlavaSpec:
    """Read a Hugging Face LLaVA checkpoint's config with transformers and validate it."""
    from transformers import AutoConfig, GenerationConfig

    from services.model.presets import resolve_model

    path = Path(resolve_model(str(model_dir)))
    if not (path / "config.json").is_file():
        raise InvalidArgument(f"{path}: no config.json; --model must be a local LLaVA checkpoint directory")
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(cfg, "model_type", None) != "llava":
        raise InvalidArgument(f"{path}: model_type is {getattr(cfg, 'model_type', None)!r}, expected 'llava'")
    vc, tc = cfg.vision_config, cfg.text_config
    if vc.model_type != "clip_vision_model":
        raise InvalidArgument(f"{path}: vision tower {vc.model_type!r} is not supported (CLIP only)")
    if tc.model_type not in ("llama", "mistral"):
        raise InvalidArgument(f"{path}: decoder {tc.model_type!r} is not supported (Llama family)")
    feature_layer = cfg.vision_feature_layer
    if not isinstance(feature_layer, int):
        raise InvalidArgument(f"{path}: vision_feature_layer={feature_layer!r}: only one layer is supported")
    layers_used = feature_layer if feature_layer >= 0 else vc.num_hidden_layers + 1 + feature_layer
    if not 0 <= layers_used <= vc.num_hidden_layers:
        raise InvalidArgument(f"{path}: vision_feature_layer={feature_layer} is outside the ViT")
    strategy = cfg.vision_feature_select_strategy
    if strategy not in ("default", "full"):
        raise InvalidArgument(f"{path}: vision_feature_select_strategy={strategy!r}")
    rope = getattr(tc, "rope_parameters", None) or {}
    rope_theta = float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", "default")
    if "dynamic" in rope_type:
        raise InvalidArgument(f"{path}: rope_type {rope_type!r} (length-dependent) is not supported")
    eos = getattr(tc, "eos_token_id", None)
    try:
        gen = GenerationConfig.from_pretrained(path, local_files_only=True)
        eos = gen.eos_token_id if gen.eos_token_id is not None else eos
    except OSError:
        pass
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return LlavaSpec(
        model_dir=path,
        model_id=str(model_dir).removeprefix("preset:") if str(model_dir).startswith("preset:") else path.name,
        vision=VisionSpec(
            hidden=vc.hidden_size,
            intermediate=vc.intermediate_size,
            layers=vc.num_hidden_layers,
            heads=vc.num_attention_heads,
            image_size=vc.image_size,
            patch_size=vc.patch_size,
            act=vc.hidden_act,
            eps=vc.layer_norm_eps,
            layers_used=layers_used,
            keep_cls=strategy == "full",
        ),
        text=TextSpec(
            hidden=tc.hidden_size,
            intermediate=tc.intermediate_size,
            layers=tc.num_hidden_layers,
            heads=tc.num_attention_heads,
            kv_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
            head_dim=head_dim,
            vocab=tc.vocab_size,
            max_context=tc.max_position_embeddings,
            rope_theta=rope_theta,
            rope_type=rope_type,
            eps=tc.rms_norm_eps,
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False) or tc.tie_word_embeddings),
            bos_token_id=getattr(tc, "bos_token_id", None),
            eos_token_ids=_eos_ids(eos),
        ),
        image_token_id=cfg.image_token_index,
        projector_act=cfg.projector_hidden_act,
        projector_bias=getattr(cfg, "multimodal_projector_bias", True),
        hf_config=cfg,
    )


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and float32 on the CPU (bf16 matmuls are slow there)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]
