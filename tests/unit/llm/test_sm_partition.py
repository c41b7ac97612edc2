"""SM partitions through green contexts, against a stand-in of cuda-bindings' driver module (the
real one ran on the H200: docs/PERF.md); the lanes' default split."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from services.llm import sm_partition
from services.llm.lane import default_prefill_sms

OK, BAD = "ok", "bad"


def fake_driver(total: int = 132, fail: str | None = None) -> tuple[types.ModuleType, list]:
    """A driver module that splits `total` SMs in groups of 8 and records what it was asked."""
    calls: list = []

    def sm(count):
        return SimpleNamespace(sm=SimpleNamespace(smCount=count, smCoscheduledAlignment=8))

    def call(name, *values):
        calls.append(name)
        return (BAD if name == fail else OK, *values)

    driver = types.ModuleType("cuda.bindings.driver")
    driver.CUresult = SimpleNamespace(CUDA_SUCCESS=OK)
    driver.CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1)
    driver.CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)
    driver.CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    driver.cuGetErrorName = lambda err: (OK, b"CUDA_ERROR_NOT_SUPPORTED")
    driver.cuDeviceGet = lambda index: call("cuDeviceGet", index)
    driver.cuDeviceGetDevResource = lambda dev, kind: call("cuDeviceGetDevResource", sm(total))

    def split(groups, whole, flags, first):
        got = -(-first // 8) * 8
        return call("cuDevSmResourceSplitByCount", [sm(got)], 1, sm(whole.sm.smCount - got))

    driver.cuDevSmResourceSplitByCount = split
    driver.cuDevResourceGenerateDesc = lambda resources, n: call("cuDevResourceGenerateDesc", resources[0])
    driver.cuGreenCtxCreate = lambda desc, dev, flags: call("cuGreenCtxCreate", ("ctx", desc.sm.smCount))
    driver.cuGreenCtxStreamCreate = lambda ctx, flags, priority: call("cuGreenCtxStreamCreate", 1000 + ctx[1])
    return driver, calls


@pytest.fixture
def driver(monkeypatch):
    def install(**kw):
        driver, calls = fake_driver(**kw)
        package = types.ModuleType("cuda.bindings")
        package.driver = driver
        monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
        monkeypatch.setitem(sys.modules, "cuda.bindings", package)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
        monkeypatch.setattr(torch.cuda, "init", lambda: None)
        monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device=None: ("stream", handle))
        return calls

    return install


def test_a_split_gives_disjoint_partitions_each_with_its_own_stream(driver):
    calls = driver()
    first, rest = sm_partition.split_sms(92, torch.device("cuda", 0))
    assert (first.sms, rest.sms) == (96, 36)  # the driver's granularity: 92 rounds up to 96
    assert first.stream == ("stream", 1096) and rest.stream == ("stream", 1036)
    assert calls.count("cuGreenCtxCreate") == 2


def test_the_prefill_lane_asks_for_its_own_partition_only(driver):
    calls = driver()
    first, rest = sm_partition.split_sms(96, torch.device("cuda", 0), rest_part=False)
    assert first.sms == 96 and rest is None
    assert calls.count("cuGreenCtxCreate") == calls.count("cuGreenCtxStreamCreate") == 1


def test_a_driver_error_and_a_bad_count_are_clear_errors(driver):
    driver(fail="cuGreenCtxCreate")
    with pytest.raises(RuntimeError, match="CUDA_ERROR_NOT_SUPPORTED"):
        sm_partition.split_sms(64, torch.device("cuda", 0))
    driver()
    with pytest.raises(RuntimeError, match="cannot split 132 of the device's 132 SMs"):
        sm_partition.split_sms(132, torch.device("cuda", 0))


def test_without_cuda_bindings_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails
    with pytest.raises(RuntimeError, match=r"vlmesh\[gpu\]"):
        sm_partition.split_sms(64, torch.device("cuda", 0))


def test_the_default_prefill_share_is_three_quarters_in_steps_of_eight():
    assert default_prefill_sms(132) == 96  # the H200
    assert default_prefill_sms(108) == 80
    assert default_prefill_sms(8) == 8
