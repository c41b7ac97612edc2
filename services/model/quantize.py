"""Quantization of the decoder, at load time, from the same checkpoint.

- `int8`: per-output-channel int8 weights with one scale each (torchao's Int8WeightOnlyConfig);
  runs on the CPU and on CUDA.
- `int4`: grouped int4 weights (groups of 128 input channels, or 64 or 32 where the widths ask
  for it; a scale and zero point each) in
  torchao's `tile_packed_to_4d` layout, whose matmul is tinygemm in core torch; CUDA and bf16
  only.
- `fp8`: e4m3 weights with one scale per output channel (services/model/qlinear.py's Fp8Linear:
  a row's largest magnitude at 448, three lines of arithmetic, no library needed); decode rows
  read them as 1 byte, prompt rows run fp8 GEMMs with per-token activation scales. A CUDA GPU of
  compute capability 8.9 or newer (Ada, Hopper) and bf16.

Only the decoder layers' projections are quantized (q/k/v, o, gate/up, down: all but a few
percent of the bytes a decode step reads). The embedding table and the LM head stay in the
model's dtype: the embedding is a gather, not a matmul, and the head decides every token.

torchao quantizes; the layers then hold its data as plain tensors (services/model/qlinear.py),
so that torch.compile does not trace its tensor subclasses. torchao is imported only when a
quantization is asked for: it is slow to import and logs a warning per optional extension it
cannot load.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from services.common.config import QUANTIZATIONS
from services.model.qlinear import Fp8Linear, Int4Linear, Int8Linear

log = logging.getLogger(__name__)

# Input channels an int4 scale and zero point cover: 128 as torchao and the published int4
# checkpoints use; a model whose widths are not whole groups of 128 (the demo model's 192) takes
# the largest of tinygemm's smaller sizes that divides them all.
INT4_GROUPS = (128, 64, 32)


def int4_group(widths: set[int]) -> int:
    """The int4 group for layers of these input widths; ValueError naming them when none fits."""
    group = next((g for g in INT4_GROUPS if all(w % g == 0 for w in widths)), None)
    if group is None:
        raise ValueError(
            f"--quantize int4 groups 32, 64 or 128 input channels; this model has layers of {sorted(widths)}"
        )
    return group


def _not_torchao_enum_notice(record: logging.LogRecord) -> bool:
    """False for torch's notice that registering an Enum as a pytree constant is deprecated: torchao
    does so on import, and only torchao can act on it."""
    return "Calling register_constant() on Enum subclasses is deprecated" not in str(record.msg)


def quantize_decoder(
    layers: nn.Module, how: str, device: torch.device, dtype: torch.dtype, emulate_fp8: bool = False
) -> None:
    """Quantize every nn.Linear under `layers` in place; ValueError naming the flag when `how` cannot run here.

    `emulate_fp8` (benchmarks' accuracy figures on a CPU, never a server): fp8 is not refused where
    it cannot run fast; off a GPU, Fp8Linear computes with the same codes and scales in fp32.
    """
    if how == "none":
        return
    if how not in QUANTIZATIONS:
        raise ValueError(f"--quantize {how!r}: use one of {', '.join(QUANTIZATIONS)}")
    linears = [m for m in layers.modules() if isinstance(m, nn.Linear)]
    if how == "int4":
        if device.type != "cuda" or dtype != torch.bfloat16:
            raise ValueError(
                f"--quantize int4 needs a CUDA GPU and bf16 (its tinygemm kernels), not {device.type} and "
                f"{str(dtype).removeprefix('torch.')}: use --quantize int8 here"
            )
        group = int4_group({m.in_features for m in linears})
    if how == "fp8":
        if not emulate_fp8:
            check_fp8(device, dtype, [m for m in layers.modules() if isinstance(m, nn.Linear | Fp8Linear)])
        before = weight_bytes(layers)
        _replace(layers, Fp8Linear.of)
        stored = sum(isinstance(m, Fp8Linear) for m in layers.modules()) - len(linears)
        log.info(
            "decoder layers in fp8 (e4m3, per-channel scales): %d quantized here, %d as the checkpoint stores them; "
            "%.1f -> %.1f MiB of weights",
            len(linears),
            stored,
            before / 2**20,
            weight_bytes(layers) / 2**20,
        )
        return
    logging.getLogger("torchao").setLevel(logging.ERROR)  # its optional extensions' load warnings
    logging.getLogger("torch.utils._pytree").addFilter(_not_torchao_enum_notice)  # added once, however often called
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    # set_inductor_config=False: by default torchao turns on inductor's coordinate-descent tuning
    # (all directions) for the whole process, which spends much of a warm-up tuning the decode
    # buckets' pointwise kernels (docs/PERF.md); bf16 compiles without it.
    if how == "int8":
        config = Int8WeightOnlyConfig(set_inductor_config=False)
    else:
        config = Int4WeightOnlyConfig(
            group_size=group, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        )
    before = weight_bytes(layers)
    quantize_(layers, config)
    _unwrap(layers)
    extra = sum(b.numel() * b.element_size() for b in layers.buffers() if b.dtype == torch.uint8)
    log.info(
        "decoder layers quantized to %s: %d linears, %.1f -> %.1f MiB of weights%s",
        how,
        len(linears),
        before / 2**20,
        weight_bytes(layers) / 2**20,
        f" (+ {extra / 2**20:.1f} MiB of unpacked codes for prompt steps)" if extra else "",
    )


FP8_CAPABILITY = (8, 9)  # Ada and Hopper: fp8 tensor cores, and Triton's e4m3 conversions


def check_fp8(device: torch.device, dtype: torch.dtype, linears: list[nn.Module]) -> None:
    """ValueError naming the device, the dtype or the widths where fp8 cannot run."""
    if device.type != "cuda":
        raise ValueError(
            f"--quantize fp8 needs a CUDA GPU of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or "
            f"newer (Ada, Hopper: fp8 tensor cores); this llm runs on {device.type}: use --quantize int8 here"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ValueError(
            f"--quantize fp8 needs compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer; "
            f"{torch.cuda.get_device_name(device)} ({device}) has {capability[0]}.{capability[1]}: "
            "use --quantize int8 or int4"
        )
    if dtype != torch.bfloat16:
        raise ValueError(f"--quantize fp8 computes in bf16, not {str(dtype).removeprefix('torch.')}: use --dtype bf16")
    odd = sorted({w for m in linears for w in (m.in_features, m.out_features) if w % 16})
    if odd:
        raise ValueError(f"--quantize fp8 needs layer widths that are multiples of 16 (fp8 GEMMs), not {odd}")


def _replace(layers: nn.Module, make) -> None:
    """Every nn.Linear under `layers` -> make(it)."""
    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def _unwrap(layers: nn.Module) -> None:
    """Every nn.Linear whose weight torchao quantized -> an Int8Linear or Int4Linear of its data."""

    def unwrapped(child: nn.Linear) -> nn.Module:
        w, bias = child.weight, child.bias
        kind = type(w).__name__
        if kind == "Int8Tensor":
            if w.block_size[-1] != w.qdata.shape[-1] or bool(w.zero_point.any()):
                raise ValueError(f"expected torchao's symmetric per-channel int8, got {w}")
            return Int8Linear(w.qdata, w.scale, bias)
        if kind == "Int4TilePackedTo4dTensor":
            return Int4Linear(w.qdata, w.scale_and_zero, w.block_size[-1], tuple(w.shape), bias)
        raise ValueError(f"torchao left a weight of {kind}, which vlmesh has no kernel for")

    _replace(layers, unwrapped)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters as stored (quantized data and scales included): what a
    decode step reads. Int4Linear's unpacked codes for prompt steps are a buffer, not counted."""
    return sum(p.numel() * p.element_size() for p in module.parameters())
