"""Where the services run when a host has several GPUs (`vlmesh up --gpus 0,1 --placement ...`).

- `single` (the default): one worker (vision, llm, gateway) on `--device`.
- `split`: one worker, its vision on the first GPU listed and its llm on the second. The features
  cross between the GPUs over CUDA IPC with peer access where the GPUs have it (services/handoff/
  cuda.py, `CUDA_IPC_PEER`), else through host shared memory; negotiation logs which.
- `replicate`: a worker per GPU listed, each with its own vision, llm and gateway, and Envoy in
  front balancing them by least outstanding requests (services/launcher/variants.py runs them as
  replicas of one variant). A request's vision and llm calls stay inside the worker whose gateway
  took it, by construction: the gateway calls its own worker's services.

With `--device cpu` the list only counts workers (`--gpus 0,1 --placement replicate` is two CPU
workers): the placement logic runs on a host without GPUs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.launcher.options import MeshOptions

PLACEMENTS = ("single", "split", "replicate")


def gpu_list(text: str) -> list[int]:
    """`0,1` -> [0, 1]; ValueError naming the flag for anything else (a repeated GPU included)."""
    if not text:
        return []
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpus {text!r}: expected GPU indices, e.g. 0,1") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {text!r}: each GPU once, as indices >= 0")
    return gpus


def check_placement(placement: str, gpus_text: str, device: str, variants: str | None) -> None:
    """ValueError naming the flag where the placement and the GPUs do not fit together."""
    if placement not in PLACEMENTS:
        raise ValueError(f"--placement {placement!r}: use one of {', '.join(PLACEMENTS)}")
    gpus = gpu_list(gpus_text)
    if placement == "single":
        if gpus:
            raise ValueError("--gpus: name a --placement (split or replicate) to use several GPUs")
        return
    if placement == "split":
        if len(gpus) != 2:
            raise ValueError(f"--placement split takes two GPUs, the vision's and the llm's (--gpus 0,1), not {gpus}")
        if device == "cpu":
            raise ValueError("--placement split puts vision and llm on two GPUs: not with --device cpu")
    elif len(gpus) < 2:
        raise ValueError(f"--placement replicate takes two GPUs or more (--gpus 0,1), not {gpus}")
    if variants:
        raise ValueError(f"--placement {placement}: not with --variants yet (a worker per variant per GPU)")


def gpu_device(device: str, gpu: int) -> str:
    """The device a service on GPU `gpu` takes: cuda:N, or the CPU when the mesh runs there."""
    return "cpu" if device == "cpu" else f"cuda:{gpu}"


def on_devices(opts: MeshOptions, vision_device: str, llm_device: str) -> MeshOptions:
    """`opts` with its vision and llm on these devices."""
    vision = dataclasses.replace(opts.vision, model=dataclasses.replace(opts.vision.model, device=vision_device))
    llm = dataclasses.replace(opts.llm, model=dataclasses.replace(opts.llm.model, device=llm_device))
    return dataclasses.replace(opts, vision=vision, llm=llm)


def split(opts: MeshOptions) -> MeshOptions:
    """A `split` mesh's options: the vision on the first GPU of --gpus, the llm on the second."""
    first, second = gpu_list(opts.gpus)
    device = opts.llm.model.device
    return on_devices(opts, gpu_device(device, first), gpu_device(device, second))


def replica_devices(opts: MeshOptions) -> list[str]:
    """A `replicate` mesh's devices, one worker each."""
    return [gpu_device(opts.llm.model.device, g) for g in gpu_list(opts.gpus)]
