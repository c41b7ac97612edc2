"""Disjoint SM partitions of one GPU: CUDA green contexts, each with a stream of its own.

Why: a prefill step is bound by compute (its GEMMs run at 770-790 TFLOP/s on the H200) and a
decode step by memory bandwidth. Time-shared, every running request waits through each prompt
step for its next token: at W1's 35 req/s prompt steps took some 58% of the engine's time and the
P99 followed them (docs/PERF.md). With the prefill on SMs of its own, the two lanes run at the
same time and a decode never waits for a prompt (services/llm/lane.py, split_loop.py). SGLang's
PD-multiplexing uses green contexts the same way.

The driver's API through NVIDIA's own Python binding (`cuda.bindings.driver`, the `gpu` extra;
the GPU hosts have it). torch's `torch.cuda.green_contexts` makes each context from the first
SMs of the device, so two of them would overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Partition:
    """SMs of one green context, and a stream whose kernels run on those SMs alone."""

    sms: int
    stream: torch.cuda.Stream
    handle: object  # the CUgreenCtx: kept alive as long as the stream is used


def _check(result) -> tuple:
    """cuda.bindings returns (CUresult, *values): raise on an error, return the values."""
    from cuda.bindings import driver

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"CUDA green contexts: {name.decode() if name else err}")
    return tuple(values)


def split_sms(first: int, device: torch.device, rest_part: bool = True) -> tuple[Partition, Partition | None]:
    """Two disjoint partitions of the device's SMs: `first` of them (the driver rounds up to its
    granularity, 8 on Hopper) and all the rest (None with `rest_part` False: no context is made for
    them). Raises RuntimeError where the driver, the device or the binding cannot (a clear
    message: the caller names the flag)."""
    try:
        from cuda.bindings import driver
    except ImportError as err:
        raise RuntimeError("SM partitions need NVIDIA's cuda-bindings (pip install 'vlmesh[gpu]')") from err
    torch.cuda.init()
    (dev,) = _check(driver.cuDeviceGet(device.index or 0))
    (whole,) = _check(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    total = whole.sm.smCount
    if not 0 < first < total:
        raise RuntimeError(f"cannot split {first} of the device's {total} SMs")
    groups, count, rest = _check(driver.cuDevSmResourceSplitByCount(1, whole, 0, first))
    if count != 1 or rest.sm.smCount == 0:
        raise RuntimeError(
            f"the driver would not split {first} of {total} SMs (granularity {whole.sm.smCoscheduledAlignment})"
        )
    parts = []
    for resource in (groups[0], rest) if rest_part else (groups[0],):
        (desc,) = _check(driver.cuDevResourceGenerateDesc([resource], 1))
        flags = driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        (ctx,) = _check(driver.cuGreenCtxCreate(desc, dev, flags))
        non_blocking = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
        (stream,) = _check(driver.cuGreenCtxStreamCreate(ctx, non_blocking, 0))
        handle = int(stream)
        parts.append(Partition(resource.sm.smCount, torch.cuda.ExternalStream(handle, device=device), ctx))
    return parts[0], parts[1] if rest_part else None


def device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
