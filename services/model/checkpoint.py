"""Load LLaVA safetensors into the plain-PyTorch modules, accepting every key layout.

Layouts seen in the wild (ARCHITECTURE.md):
- transformers 5.x saves `vision_tower.embeddings.*`, `vision_tower.encoder.*`,
  `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`;
- published LLaVA-1.5 uses `vision_tower.vision_model.*`;
- transformers 4.5x in-memory names use `model.vision_tower.*`, `model.language_model.*`
  and a top-level `lm_head.*`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from services.common.errors import InvalidArgument
from services.model.clip import VisionTower
from services.model.files import check_safetensors, weight_files
from services.model.llama import LlamaDecoder
from services.model.presets import init_random, is_random
from services.model.spec import LlavaSpec

# (pattern, part, replacement): the first match names the part and the key inside it.
_RULES = [
    (re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$"), "vision", r"\1"),
    (re.compile(r"^(?:model\.)?multi_modal_projector\.(.*)$"), "vision", r"multi_modal_projector.\1"),
    (re.compile(r"^(?:language_model\.|model\.language_model\.)lm_head\.(.*)$"), "text", r"lm_head.\1"),
    (re.compile(r"^lm_head\.(.*)$"), "text", r"lm_head.\1"),
    (
        re.compile(r"^(?:language_model\.model\.|model\.language_model\.|language_model\.)(.*)$"),
        "text",
        r"\1",
    ),
]


def canonical_key(key: str) -> tuple[str, str] | None:
    """Map a checkpoint key to (part, module key); None for keys no service uses."""
    for pattern, part, repl in _RULES:
        if pattern.match(key):
            return part, pattern.sub(repl, key)
    return None


def read_state_dict(model_dir: Path, part: str, wanted: set[str]) -> dict[str, torch.Tensor]:
    """Read the tensors of one part ('vision' or 'text') whose module keys are in `wanted`.

    A shard safetensors cannot read (cut short, corrupt) is an InvalidArgument naming the file.
    """
    out: dict[str, torch.Tensor] = {}
    for shard in weight_files(model_dir):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for key in f.keys():
                    mapped = canonical_key(key)
                    if mapped and mapped[0] == part and mapped[1] in wanted:
                        out[mapped[1]] = f.get_tensor(key)
        except (SafetensorError, OSError) as err:
            check_safetensors(shard)  # names what is wrong with the file when it can tell
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise InvalidArgument(f"{shard}: cannot read these safetensors weights: {reason}") from None
    return out


def _load(module: nn.Module, model_dir: Path, part: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    if is_random(model_dir):  # a benchmark preset: no weights on disk
        return init_random(module, device, dtype)
    wanted = set(module.state_dict().keys())
    state = read_state_dict(model_dir, part, wanted)
    missing = wanted - state.keys()
    if missing:
        raise InvalidArgument(f"{model_dir}: {part} weights missing from the checkpoint: {sorted(missing)[:5]}")
    module.load_state_dict(state, assign=True)
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_vision_tower(spec: LlavaSpec, device: torch.device, dtype: torch.dtype) -> VisionTower:
    """The ViT and projector's weights, q/k/v fused as its forward needs."""
    with torch.device("meta"):
        tower = VisionTower(spec)
    tower = _load(tower, spec.model_dir, "vision", device, dtype)
    tower.fuse_projections()
    return tower  # type: ignore[return-value]


def load_decoder(spec: LlavaSpec, device: torch.device, dtype: torch.dtype, fuse: bool = True) -> LlamaDecoder:
    """The decoder's weights; with `fuse`, q/k/v and gate/up concatenated as its forward needs."""
    decoder = _load_decoder(spec, device, dtype)
    if fuse:
        decoder.fuse_projections()
    return decoder


def _load_decoder(spec: LlavaSpec, device: torch.device, dtype: torch.dtype) -> LlamaDecoder:
    with torch.device("meta"):
        decoder = LlamaDecoder(spec.text)
    if spec.text.tie_embeddings and not is_random(spec.model_dir):
        # Tied checkpoints carry no lm_head tensor; share the embedding matrix instead.
        state = read_state_dict(spec.model_dir, "text", {"embed_tokens.weight", "lm_head.weight"})
        if "lm_head.weight" not in state:
            decoder.lm_head = nn.Identity()  # replaced below, after loading
            decoder = _load(decoder, spec.model_dir, "text", device, dtype)  # type: ignore[assignment]
            head = nn.Linear(spec.text.hidden, spec.text.vocab, bias=False, device=device, dtype=dtype)
            head.weight = decoder.embed_tokens.weight
            decoder.lm_head = head
            return decoder
    return _load(decoder, spec.model_dir, "text", device, dtype)  # type: ignore[return-value]
