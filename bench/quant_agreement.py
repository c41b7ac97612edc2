"""Quantization's accuracy on the decoder itself: teacher-forced next-token agreement with fp32, and
the logits' cosine similarity to bf16 and to fp32, for bf16 and each `--quantize` kind.

    python -m bench.quant_agreement --model preset:llava-7b-shaped --device cuda --kinds int8,fp8

transformers' own model of the checkpoint's family runs in fp32 (the reference), then in bf16, then
in bf16 with its decoder layers' projections replaced by vlmesh's quantized ones
(services/model/quantize.py: the same modules and codes the engine serves). Every one reads the
same `--sequences` random token sequences of `--tokens` positions (text only: the picture's path
is the same in every kind), and each position's argmax is compared with fp32's. A preset's random
weights are made once, seeded, and copied into each kind.

A CPU refuses fp8 as a server does, unless `--emulate-fp8`: the same codes and scales, computed in
fp32, for a trained model that fits the CPU (`--model models/demo --kinds int8,fp8 --emulate-fp8`).

It prints a table and, with `--out`, writes the figures as JSON. Issue 44's criterion: fp8's
agreement no more than 1 point below bf16's.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from services.common.config import QUANTIZATIONS
from services.model.presets import is_random, resolve_model
from services.model.quantize import quantize_decoder
from services.model.spec import load_spec

SEED = 4401  # the sequences' and a preset's weights'


def load_fp32(model_dir: str, device: torch.device):
    """transformers' model of the checkpoint in fp32 on `device` (a preset: its random init, seeded)."""
    from transformers import AutoModelForImageTextToText

    spec = load_spec(model_dir)
    if is_random(spec.model_dir):
        torch.manual_seed(SEED)
        with device:
            return AutoModelForImageTextToText.from_config(spec.hf_config).float().eval(), spec
    model = AutoModelForImageTextToText.from_pretrained(spec.model_dir, dtype=torch.float32)
    return model.to(device).eval(), spec


def decoder_layers(model) -> torch.nn.Module:
    """The decoder's layers, whose projections `--quantize` replaces (the embedding and LM head stay)."""
    return model.get_decoder().layers


@torch.no_grad()
def logits_of(model, seqs: torch.Tensor) -> list[torch.Tensor]:
    """Each sequence's logits [T, V] in fp32, one sequence at a time."""
    return [model(input_ids=s[None]).logits[0].float() for s in seqs]


def compare(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """Argmax agreement, and the mean and lowest per-position cosine similarity, of `got` against `ref`."""
    same = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(got, ref, strict=True))
    cos = torch.cat([torch.nn.functional.cosine_similarity(g, r, dim=-1) for g, r in zip(got, ref, strict=True)])
    return {"agreement": same / cos.numel(), "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quant_agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preset:llava-7b-shaped", help="checkpoint directory or preset:NAME")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default %(default)s)")
    kinds = [q for q in QUANTIZATIONS if q != "none"]
    p.add_argument(
        "--kinds", default=",".join(kinds), help=f"quantized kinds beside bf16, of {kinds} (default %(default)s)"
    )
    p.add_argument("--sequences", type=int, default=16, help="random token sequences (default %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="positions in each (default %(default)s)")
    p.add_argument(
        "--emulate-fp8",
        action="store_true",
        help="on a CPU, run fp8 with its codes and scales in fp32 instead of refusing it (a trained model "
        "that fits the CPU, e.g. models/demo)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    wanted = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in wanted if k not in kinds]
    if unknown:
        p.error(f"--kinds {','.join(unknown)}: use some of {','.join(kinds)}")
    device = torch.device(args.device)
    if args.emulate_fp8 and device.type != "cpu":
        p.error(f"--emulate-fp8 is for a CPU; on {device} fp8 runs its own kernels (or is refused): drop it")
    for kind in wanted:  # a kind that cannot run here fails now, not after the fp32 and bf16 passes
        try:
            probe = torch.nn.Linear(128, 128, device=device, dtype=torch.bfloat16)
            quantize_decoder(probe, kind, device, torch.bfloat16, emulate_fp8=args.emulate_fp8)
        except ValueError as err:
            p.error(f"--kinds {kind}: {err}")

    def say(msg: str) -> None:
        print(f"quant_agreement: {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    fp32, spec = load_fp32(resolve_model(args.model), device)
    say(f"{spec.model_id} loaded in fp32 on {device} ({time.perf_counter() - t0:.0f} s)")
    gen = torch.Generator().manual_seed(SEED)
    seqs = torch.randint(0, spec.text.vocab, (args.sequences, args.tokens), generator=gen).to(device)
    ref = logits_of(fp32, seqs)
    ref_cpu = [r.cpu() for r in ref]
    del ref
    rows: dict[str, dict] = {}
    bf16_logits: list[torch.Tensor] = []
    for kind in ["bf16", *wanted]:
        model = copy.deepcopy(fp32).to(torch.bfloat16)
        if kind != "bf16":
            try:
                quantize_decoder(decoder_layers(model), kind, device, torch.bfloat16, emulate_fp8=args.emulate_fp8)
            except ValueError as err:
                p.error(f"--kinds {kind}: {err}")
        got = [g.cpu() for g in logits_of(model, seqs)]
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows[kind] = {"vs_fp32": compare(got, ref_cpu)}
        if kind == "bf16":
            bf16_logits = got
        else:
            rows[kind]["vs_bf16"] = compare(got, bf16_logits)
        say(f"{kind}: agreement with fp32 {rows[kind]['vs_fp32']['agreement']:.2%}")
    result = {
        "model": spec.model_id,
        "device": str(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu",
        "sequences": args.sequences,
        "tokens": args.tokens,
        "fp8_emulated": args.emulate_fp8 and "fp8" in wanted,
        "kinds": rows,
    }
    print(f"{'kind':6} {'argmax = fp32':>14} {'cos fp32 mean':>14} {'cos bf16 mean':>14} {'cos bf16 min':>13}")
    for kind, row in rows.items():
        vs32, vs16 = row["vs_fp32"], row.get("vs_bf16")
        cos16 = f"{vs16['cosine_mean']:14.5f} {vs16['cosine_min']:13.5f}" if vs16 else f"{'-':>14} {'-':>13}"
        print(f"{kind:6} {vs32['agreement']:14.2%} {vs32['cosine_mean']:14.5f} {cos16}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
