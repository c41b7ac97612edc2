"""Load a checkpoint's safetensors into the plain-PyTorch modules, accepting every key layout.

The decoder's keys are the same in every family (`language_model.model.*` or
`model.language_model.*`, or `model.*` in the hub's Qwen2.5-VL, and `lm_head.*` at the top or
under `language_model.`); the vision
side's are the family's to name (`Family.vision_key`).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from services.common.errors import InvalidArgument
from services.model.family import Family, family_of, rename_key
from services.model.files import check_safetensors, weight_files
from services.model.llama import LlamaDecoder
from services.model.presets import init_random, is_random
from services.model.spec import ModelSpec
from services.model.stored_fp8 import (
    FP8_DTYPE,
    SERVED,
    check_fusable,
    check_scale,
    is_projection,
    place,
    scale_key,
)

# (pattern, replacement): the first match names the decoder's module key.
_TEXT_KEYS = [
    (re.compile(r"^(?:language_model\.|model\.language_model\.)lm_head\.(.*)$"), r"lm_head.\1"),
    (re.compile(r"^lm_head\.(.*)$"), r"lm_head.\1"),
    (re.compile(r"^(?:language_model\.model\.|model\.language_model\.|language_model\.)(.*)$"), r"\1"),
    (re.compile(r"^model\.((?:embed_tokens|layers|norm)\..*)$"), r"\1"),  # the hub's Qwen2.5-VL
]


def canonical_key(key: str, family: Family | None = None) -> tuple[str, str] | None:
    """Map a checkpoint key to (part, module key), part 'vision' or 'text'; None for keys no service uses."""
    from services.model.llava import LLAVA

    vision = (family or LLAVA).vision_key(key)
    if vision is not None:
        return "vision", vision
    text = rename_key(_TEXT_KEYS, key)
    return None if text is None else ("text", text)


# module key -> (shard, checkpoint key, shape, safetensors dtype): where one part's weights are, from the headers.
Found = dict[str, tuple[Path, str, tuple[int, ...], str]]


def _find(spec: ModelSpec, part: str) -> Found:
    """One part's ('vision' or 'text') weights in the shards' headers (no tensor is read).

    A shard safetensors cannot read (cut short, corrupt) is an InvalidArgument naming the file.
    """
    family, out = family_of(spec), {}
    for shard in weight_files(spec.model_dir):
        with _reading(shard) as f:
            for key in f.keys():
                mapped = canonical_key(key, family)
                if mapped and mapped[0] == part:
                    tensor = f.get_slice(key)
                    out[mapped[1]] = (shard, key, tuple(tensor.get_shape()), tensor.get_dtype())
    return out


@contextlib.contextmanager
def _reading(shard: Path):
    """safe_open(shard), a failure to read it (cut short, corrupt) an InvalidArgument naming the file."""
    try:
        with safe_open(str(shard), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as err:
        check_safetensors(shard)  # names what is wrong with the file when it can tell
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise InvalidArgument(f"{shard}: cannot read these safetensors weights: {reason}") from None


def _check(module: nn.Module, spec: ModelSpec, part: str) -> Found:
    """The weights `module` needs, each present with the shape the config implies, and the scales
    of those stored in fp8; else one InvalidArgument naming the directory and the missing keys, or
    the shard, key and both shapes."""
    shapes = {key: tuple(t.shape) for key, t in module.state_dict().items()}  # meta tensors: shapes only
    found = _find(spec, part)
    missing = sorted(shapes.keys() - found.keys())
    if missing:
        raise InvalidArgument(f"{spec.model_dir}: {part} weights missing from the checkpoint: {missing[:5]}")
    needed = {}
    for key, want in shapes.items():
        shard, name, shape, dtype = needed[key] = found[key]
        if shape != want:
            raise InvalidArgument(f"{shard}: {name} is {shape}, but {spec.model_dir}/config.json implies {want}")
        if dtype == FP8_DTYPE:
            if part != "text" or spec.stored_quantization != "fp8" or not is_projection(key):
                raise InvalidArgument(
                    f"{shard}: {name} is stored in fp8; vlmesh reads fp8 codes only for the decoder's projections "
                    f"of a checkpoint whose config.json names {SERVED}"
                )
            scale = found.get(scale_key(key))
            check_scale(shard, name, shape, None if scale is None else scale[2])
            needed[scale_key(key)] = scale  # type: ignore[assignment]
    check_fusable(needed)
    return needed


def _read(found: Found) -> dict[str, torch.Tensor]:
    by_shard: dict[Path, list[tuple[str, str]]] = {}
    for key, (shard, name, _, _) in found.items():
        by_shard.setdefault(shard, []).append((key, name))
    out = {}
    for shard, keys in by_shard.items():
        with _reading(shard) as f:
            out.update({key: f.get_tensor(name) for key, name in keys})
    return out


def _load(
    module: nn.Module, spec: ModelSpec, part: str, device: torch.device, dtype: torch.dtype, keep_fp8: bool = False
) -> nn.Module:
    """`module` with its weights, on `device` in `dtype`; projections stored in fp8 kept as
    Fp8Linear with `keep_fp8`, else multiplied out to `dtype` (services/model/stored_fp8.py)."""
    if is_random(spec.model_dir):  # a benchmark preset: no weights on disk
        return init_random(module, device, dtype)
    tensors = _read(_check(module, spec, part))
    codes = [key for key, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    stored = {key: (tensors.pop(key), tensors.pop(scale_key(key))) for key in codes}
    for key in codes:  # a placeholder through the move below, which would cast e4m3 codes to `dtype`
        module.get_submodule(key.removesuffix(".weight")).weight = nn.Parameter(torch.empty(0), requires_grad=False)
    module.load_state_dict(tensors, assign=True, strict=not codes)
    module = module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    place(module, stored, keep_fp8, device, dtype)
    return module


def _tied(spec: ModelSpec) -> bool:
    """A tied checkpoint without an lm_head tensor: the head shares the embedding matrix."""
    return spec.text.tie_embeddings and not is_random(spec.model_dir) and "lm_head.weight" not in _find(spec, "text")


def _meta_module(spec: ModelSpec, part: str) -> nn.Module:
    with torch.device("meta"):
        if part == "vision":
            return family_of(spec).build_tower(spec)
        decoder = LlamaDecoder(spec.text)
        if _tied(spec):
            decoder.lm_head = nn.Identity()  # type: ignore[assignment]  # shared after loading
        return decoder


def check_weights(spec: ModelSpec, part: str) -> None:
    """Before loading: the checkpoint holds every weight of `part` in the shape its config implies
    (InvalidArgument naming the file and the key otherwise). Reads the headers, no tensor."""
    if is_random(spec.model_dir) or not all(shard.is_file() for shard in weight_files(spec.model_dir)):
        return  # a preset has no weights; a pipe or a device is read once, by the loader
    _check(_meta_module(spec, part), spec, part)


def load_vision_tower(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The family's tower(s) and projector with their weights, prepared as its forward needs."""
    tower = _load(_meta_module(spec, "vision"), spec, "vision", device, dtype)
    family_of(spec).prepare_tower(tower)
    return tower


def load_decoder(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, fuse: bool = True, keep_fp8: bool = False
) -> LlamaDecoder:
    """The decoder's weights; with `fuse`, q/k/v and gate/up concatenated as its forward needs. A
    checkpoint's fp8 projections stay fp8 with `keep_fp8` (`--quantize fp8`), else are multiplied out."""
    decoder = _load_decoder(spec, device, dtype, keep_fp8)
    if fuse:
        decoder.fuse_projections()
    return decoder


def _load_decoder(spec: ModelSpec, device: torch.device, dtype: torch.dtype, keep_fp8: bool) -> LlamaDecoder:
    decoder: LlamaDecoder = _load(_meta_module(spec, "text"), spec, "text", device, dtype, keep_fp8)  # type: ignore[assignment]
    if isinstance(decoder.lm_head, nn.Identity):  # tied: the head is the embedding matrix
        head = nn.Linear(spec.text.hidden, spec.text.vocab, bias=False, device=device, dtype=dtype)
        head.weight = decoder.embed_tokens.weight
        decoder.lm_head = head
    return decoder


def preflight(model_dir: str | Path, parts: tuple[str, ...] = ("vision", "text"), tokenizer: bool = True) -> ModelSpec:
    """Everything about a checkpoint that can fail without loading it: its files (whole, a
    tokenizer), its config (the family's checks) and its weights' names and shapes. The CLI runs
    it before a service binds a port, so a bad checkpoint is one line, not a failed start."""
    import logging

    from services.model.files import check_checkpoint
    from services.model.spec import load_spec

    check_checkpoint(model_dir, weights=True, tokenizer=tokenizer)
    spec = load_spec(model_dir)
    # Building a tower imports transformers' modeling code, whose optional back-ends (torchao)
    # log warnings on import; here, before the command's own logging, they would bury its one line.
    logging.disable(logging.WARNING)
    try:
        for part in parts:
            check_weights(spec, part)
    finally:
        logging.disable(logging.NOTSET)
    return spec
