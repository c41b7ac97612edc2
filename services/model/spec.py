"""What the services need to know of a checkpoint, read from its config.json: the decoder's
shape (every family's decoder is Llama-like), and the family's own vision description."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.common.errors import InvalidArgument


@dataclass(frozen=True)
class VisionSpec:
    """A plain ViT (CLIP's or SigLIP's): the layers services/model/clip.py builds."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    image_size: int
    patch_size: int
    act: str
    eps: float
    # How many encoder layers to run: LLaVA reads hidden_states[feature_layer], so the
    # layers after it are never built.
    layers_used: int
    # Keep the CLS token ("full") or drop it ("default"); SigLIP has none.
    keep_cls: bool

    @classmethod
    def from_hf(cls, vc: object, layers_used: int, keep_cls: bool) -> VisionSpec:
        """From a transformers CLIP or SigLIP vision config."""
        return cls(
            hidden=vc.hidden_size,  # type: ignore[attr-defined]
            intermediate=vc.intermediate_size,  # type: ignore[attr-defined]
            layers=vc.num_hidden_layers,  # type: ignore[attr-defined]
            heads=vc.num_attention_heads,  # type: ignore[attr-defined]
            image_size=vc.image_size,  # type: ignore[attr-defined]
            patch_size=vc.patch_size,  # type: ignore[attr-defined]
            act=vc.hidden_act,  # type: ignore[attr-defined]
            eps=vc.layer_norm_eps,  # type: ignore[attr-defined]
            layers_used=layers_used,
            keep_cls=keep_cls,
        )

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
    qkv_bias: bool = False  # Qwen2: q/k/v projections with a bias
    # Multimodal RoPE (Qwen2.5-VL): the rotary channels' split between a position's (t, h, w)
    # components, in frequency pairs; None for plain RoPE.
    mrope_section: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """What every service needs of a checkpoint, whatever its family (services/model/family.py)."""

    model_dir: Path
    model_id: str
    family: str  # the name of the Family that read it ("llava", "deepseek_vl")
    text: TextSpec
    image_token_id: int
    placeholder: str  # the tokenizer's image placeholder token ("<image>", "<image_placeholder>")
    image_tokens: int  # feature positions per image; where they vary, the most one image takes
    vision: object  # the family's own description of its tower(s)
    hf_config: object  # the transformers config, for rope set-up of non-default types
    # Pictures take positions by their size: features travel as [rows, cols, H], their grid of
    # tokens (M-RoPE reads it); otherwise as [image_tokens, H].
    image_grid: bool = False
    # How the decoder's projections are stored: `none` (full precision) or `fp8` (compressed-tensors
    # e4m3 codes and scales; services/model/stored_fp8.py).
    stored_quantization: str = "none"


def _eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def model_id(model_dir: str | Path, path: Path) -> str:
    """A preset's name, or the checkpoint directory's."""
    text = str(model_dir)
    return text.removeprefix("preset:") if text.startswith("preset:") else path.name


def text_spec(path: Path, cfg: object) -> TextSpec:
    """The Llama-family decoder of a vision-language config (`cfg.text_config`)."""
    from transformers import GenerationConfig

    tc = cfg.text_config  # type: ignore[attr-defined]
    qwen = tc.model_type in ("qwen2", "qwen2_5_vl_text")
    if tc.model_type not in ("llama", "mistral") and not qwen:
        raise InvalidArgument(
            f"{path}/config.json: text_config.model_type {tc.model_type!r} is not supported (Llama family, Qwen2)"
        )
    rope = getattr(tc, "rope_parameters", None) or {}
    mrope = rope.get("mrope_section") if tc.model_type == "qwen2_5_vl_text" else None
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if mrope is not None and (len(mrope) != 3 or sum(mrope) != head_dim // 2):
        raise InvalidArgument(
            f"{path}/config.json: text_config.rope_parameters.mrope_section {mrope} must be 3 parts "
            f"summing to head_dim / 2 = {head_dim // 2}"
        )
    rope_theta = float(rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "mrope":  # older Qwen2.5-VL configs name M-RoPE as a type; its frequencies are the default's
        rope_type = "default"
    if "dynamic" in rope_type:
        raise InvalidArgument(f"{path}/config.json: rope_type {rope_type!r} (length-dependent) is not supported")
    eos = getattr(tc, "eos_token_id", None)
    try:
        gen = GenerationConfig.from_pretrained(path, local_files_only=True)
        eos = gen.eos_token_id if gen.eos_token_id is not None else eos
    except OSError:
        pass
    return TextSpec(
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
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False)),
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_ids=_eos_ids(eos),
        qkv_bias=qwen,
        mrope_section=tuple(mrope) if mrope is not None else None,
    )


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read a Hugging Face checkpoint's config with transformers; its `model_type` names the family."""
    from transformers import AutoConfig

    from services.model.family import family_for
    from services.model.presets import resolve_model
    from services.model.stored_fp8 import stored_quantization

    path = Path(resolve_model(str(model_dir)))
    config = path / "config.json"
    if not config.is_file():
        raise InvalidArgument(f"{path}: no config.json; --model must be a local checkpoint directory")
    try:
        raw = json.loads(config.read_text())
        model_type = raw.get("model_type")
    except (ValueError, AttributeError):
        raise InvalidArgument(f"{config}: not a JSON object") from None
    family = family_for(model_type, config)
    stored = stored_quantization(raw, config)
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, TypeError, KeyError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise InvalidArgument(f"{config}: transformers cannot read it: {reason}") from None
    return replace(family.read_spec(path, cfg, model_id(model_dir, path)), stored_quantization=stored)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and float32 on the CPU (bf16 matmuls are slow there)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]
