"""Checkpoints whose decoder weights are stored fp8, as compressed-tensors writes them.

llm-compressor's FP8 schemes (FP8_DYNAMIC, FP8), which vLLM and SGLang serve, store each
quantized projection as `weight` in e4m3 [out, in] beside `weight_scale` (fp32 or bf16; one per
output channel, [out, 1], or one for the tensor) and say so in config.json's
`quantization_config` (`quant_method: compressed-tensors`, `format: float-quantized`). That is
Fp8Linear's own layout, so the llm serves the codes as stored with `--quantize fp8`, or
multiplies them out to its dtype with `--quantize none` (a GPU without fp8, the CPU). Re-quantizing
them to int8 or int4 would round twice: refused. Activations are quantized per token at run time
whatever the checkpoint says (a static `input_scale` is not read): dynamic per-token scales are
what FP8_DYNAMIC asks for, and at least as close for the static scheme.

Any other stored form (AWQ, GPTQ, block-wise fp8, int8 codes, an fp8 KV cache, quantized vision
weights) is refused at start-up with one line naming the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from services.common.errors import InvalidArgument
from services.model.qlinear import Fp8Linear, fp8_rows
from services.model.spec import ModelSpec

FP8_DTYPE = "F8_E4M3"  # safetensors' name for torch.float8_e4m3fn
SERVED = (
    "compressed-tensors fp8 (format float-quantized: e4m3 weights, one scale per output channel or per tensor), "
    "as llm-compressor's FP8 and FP8_DYNAMIC schemes write it"
)


def stored_quantization(raw: dict, config: Path) -> str:
    """`none` for a full-precision checkpoint, `fp8` for the stored form vlmesh serves; an
    InvalidArgument naming the field for any other `quantization_config`."""
    for where, block in (("", raw), ("text_config.", raw.get("text_config") or {})):
        found = block.get("quantization_config") if isinstance(block, dict) else None
        if found:
            _check_scheme(found, f"{config}: {where}quantization_config")
            return "fp8"
    return "none"


def _check_scheme(qc: object, where: str) -> None:
    def refuse(field: str, value: object) -> InvalidArgument:
        return InvalidArgument(f"{where}.{field} is {value!r}: vlmesh loads only {SERVED}")

    if not isinstance(qc, dict):
        raise InvalidArgument(f"{where}: not a JSON object")
    if qc.get("quant_method") != "compressed-tensors":
        raise refuse("quant_method", qc.get("quant_method"))
    if qc.get("format") not in ("float-quantized", "naive-quantized"):
        raise refuse("format", qc.get("format"))
    if qc.get("kv_cache_scheme"):
        raise refuse("kv_cache_scheme", qc["kv_cache_scheme"])
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("config_groups", groups)
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise refuse(f"config_groups.{name}.weights", weights)
        for field, want in (("type", "float"), ("num_bits", 8), ("symmetric", True)):
            if weights.get(field, want) != want:
                raise refuse(f"config_groups.{name}.weights.{field}", weights.get(field))
        if weights.get("strategy") not in ("channel", "tensor"):
            raise refuse(f"config_groups.{name}.weights.strategy", weights.get("strategy"))
        acts = group.get("input_activations")
        if acts and (acts.get("type") != "float" or acts.get("num_bits") != 8):
            raise refuse(f"config_groups.{name}.input_activations", acts)
        if group.get("output_activations"):
            raise refuse(f"config_groups.{name}.output_activations", group["output_activations"])


def check_quantize(spec: ModelSpec, quantize: str) -> None:
    """INVALID_ARGUMENT for a --quantize that would round a checkpoint's fp8 codes a second time."""
    if spec.stored_quantization == "fp8" and quantize not in ("fp8", "none"):
        raise InvalidArgument(
            f"{spec.model_dir}: its decoder is stored in fp8 (compressed-tensors); --quantize {quantize} would round "
            "those codes again: serve it with --quantize fp8, or none to multiply them out to the model's dtype"
        )


def scale_key(weight_key: str) -> str:
    """`...q_proj.weight` -> `...q_proj.weight_scale`."""
    return weight_key + "_scale"


def check_scale(shard: Path, name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...] | None) -> None:
    """A stored fp8 weight has a scale per output channel or one for the tensor; else InvalidArgument."""
    if scale_shape is None:
        raise InvalidArgument(f"{shard}: {name} is stored in fp8 but the checkpoint has no {scale_key(name)}")
    out = weight_shape[0]
    if scale_shape not in ((out, 1), (out,), (1,), ()):
        raise InvalidArgument(
            f"{shard}: {scale_key(name)} is {scale_shape}: vlmesh reads one scale per output channel ({out}, 1) "
            "or one for the tensor (block-wise and grouped scales are not served)"
        )


# Projections the decoder runs as one matmul (services/model/fuse.py): stored alike, or refused.
_FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def check_fusable(found: dict[str, tuple[Path, str, tuple[int, ...], str]]) -> None:
    """InvalidArgument where some of q/k/v (or gate/up) are stored in fp8 and others are not:
    the decoder fuses them into one projection, stored one way. `found`: module key -> (shard,
    checkpoint key, shape, safetensors dtype)."""
    for key, (shard, name, _, dtype) in found.items():
        for block, parts in _FUSED:
            first = f".{block}.{parts[0]}.weight"
            if not key.endswith(first):
                continue
            for part in parts[1:]:
                other = found.get(key.replace(first, f".{block}.{part}.weight"))
                if other is not None and (other[3] == FP8_DTYPE) != (dtype == FP8_DTYPE):
                    stored, plain = (name, other[1]) if dtype == FP8_DTYPE else (other[1], name)
                    raise InvalidArgument(
                        f"{shard}: {stored} is stored in fp8 but {plain} is not; vlmesh runs "
                        f"{'/'.join(p.removesuffix('_proj') for p in parts)} as one projection, stored one way"
                    )


@torch.no_grad()
def place(
    decoder: nn.Module,
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]],
    keep: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Put each stored projection (module key `a.b.weight` -> e4m3 codes [out, in], scales) into
    `decoder`, whose other weights are loaded: with `keep`, as an Fp8Linear holding the codes as
    stored; otherwise as the nn.Linear's weight, codes x scales in `dtype`."""
    for key, (codes, scales) in stored.items():
        path = key.removesuffix(".weight")
        parent_path, _, name = path.rpartition(".")
        parent = decoder.get_submodule(parent_path)
        linear = getattr(parent, name)
        out = codes.shape[0]
        s = scales.float().reshape(-1).expand(out).to(device)  # one a channel
        q = codes.to(device)
        if keep:
            setattr(parent, name, Fp8Linear(q, s, linear.bias))
        else:
            linear.weight = nn.Parameter((q.float() * s[:, None]).to(dtype), requires_grad=False)


# The projections a compressed-tensors checkpoint of a Llama-like decoder quantizes.
_PROJECTIONS = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def is_projection(key: str) -> bool:
    """A decoder layer's projection weight (checkpoint or module key): what may be stored in fp8."""
    return _PROJECTIONS.search(key) is not None


@torch.no_grad()
def store_fp8(model_dir: Path) -> None:
    """Rewrite a full-precision checkpoint in place with its decoder projections in compressed-tensors
    fp8 (per-channel e4m3 codes and fp32 scales: FP8_DYNAMIC's form), `quantization_config` in its
    config.json: what `vlmesh make-tiny-model --stored fp8` ships and the tests load."""
    from safetensors.torch import load_file, save_file

    from services.model.files import weight_files

    for shard in weight_files(model_dir):
        tensors, out = load_file(shard), {}
        for key, t in tensors.items():
            if is_projection(key) and "vision" not in key:
                codes, scales = fp8_rows(t.float())  # [out, in] e4m3, [out, 1] fp32
                out[key], out[scale_key(key)] = codes.contiguous(), scales.contiguous()
            else:
                out[key] = t
        save_file(out, shard, metadata={"format": "pt"})
    config = model_dir / "config.json"
    raw = json.loads(config.read_text())
    raw["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
        "ignore": ["lm_head", "re:.*vision.*", "re:.*projector.*", "re:.*aligner.*", "re:.*merger.*"],
    }
    config.write_text(json.dumps(raw, indent=2))
