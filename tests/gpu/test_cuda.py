"""The same checkpoint on the GPU: in-process engine and the full three-process mesh."""

from __future__ import annotations

import grpc
import pytest
import torch

from services.launcher import Mesh, MeshOptions
from services.llm.interface import EngineStats
from tests.helpers import CASES, PROMPTS, Parts, assert_greedy_under_transformers, image_bytes
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32")]


def run_all(parts, n_tokens: int) -> list[list[int]]:
    pairs = [parts.request(i, p, max_tokens=n_tokens, min_tokens=n_tokens) for i, p in enumerate(PROMPTS)]
    parts.run(*pairs)
    return [box["ids"] for _, box in pairs]


def test_cuda_engine_matches_cpu_engine(tiny_model):
    cpu = Parts(tiny_model, max_batch=3)
    gpu = Parts(tiny_model, max_batch=3, device="cuda", dtype="float32")
    try:
        assert run_all(gpu, 16) == run_all(cpu, 16)
    finally:
        cpu.engine.stop()
        gpu.engine.stop()


def test_cuda_engine_bf16_runs(tiny_model):
    gpu = Parts(tiny_model, max_batch=3, device="cuda", dtype="bfloat16")
    try:
        outs = run_all(gpu, 16)
        assert all(len(ids) == 16 for ids in outs)
        assert gpu.engine.stats() == EngineStats(running=0, waiting=0, free_slots=3)
    finally:
        gpu.engine.stop()


@pytest.mark.parametrize("model", ["tiny_model", "tiny_deepseek_hybrid", "tiny_deepseek"])
def test_mesh_on_gpu_matches_transformers(model, request):
    """LLaVA and both DeepSeek-VL types: every token the whole mesh gives in fp32 is transformers' argmax."""
    tiny_model = request.getfixturevalue(model)
    opts = MeshOptions.from_flags(
        model=str(tiny_model),
        gateway_port=0,
        vision_port=0,
        llm_port=0,
        device="cuda",
        dtype="float32",
        warmup_requests=1,
        log_level="warning",
        extra_env={"NVIDIA_TF32_OVERRIDE": "0"},
    )
    with Mesh(opts) as mesh:
        mesh.start(progress=lambda m: None)  # port 0: the gateway's port is known once it serves
        channel = grpc.insecure_channel(mesh.target("gateway"))
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for data, prompt in CASES:
            req = gateway_pb2.GenerateRequest(
                images=[pb.Image(data=data)], prompt=prompt, sampling=pb.SamplingParams(max_tokens=16, min_tokens=16)
            )
            result = stub.GenerateUnary(req, timeout=120)
            assert len(result.token_ids) == 16
            assert_greedy_under_transformers(tiny_model, data, prompt, list(result.token_ids), "cuda")
        bad = gateway_pb2.GenerateRequest(images=[pb.Image(data=b"nope")], prompt="x")
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(bad, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        channel.close()
        assert image_bytes(1)  # the fixture helpers import on the GPU host too


def test_token_fetch_times_the_device_span_and_returns_the_tokens():
    """--step-trace's split of a CUDA step: the device span covers the work queued after mark()."""
    import time

    from services.llm.transfers import TokenFetch

    fetch = TokenFetch(4, torch.device("cuda"))
    fetch.timed = True
    a = torch.randn(4096, 4096, device="cuda")
    fetch.mark()
    for _ in range(20):  # some milliseconds of device work
        a = a @ a / 64.0
    tokens = a[:3, 0].long()
    got = fetch.fetch(tokens)
    waited = (time.perf_counter() - fetch.marked_at) * 1e3
    device = fetch.device_ms()
    assert got == tokens.tolist() and fetch.tokens[:3].tolist() == got  # kept on the device for the next step
    assert 0 < device <= waited + 0.5  # the span ended before the host returned from the sync
    assert fetch.device_ms() is None  # read once per step
    assert TokenFetch(2, torch.device("cuda")).fetch(None) == []  # no token: still ends with its work
