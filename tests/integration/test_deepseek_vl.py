"""DeepSeek-VL through the whole mesh, as LLaVA is served: greedy tokens equal transformers' own
`generate` (fp32, CPU) for pictures of several sizes and aspect ratios, for both model types
(`deepseek_vl_hybrid`: SigLIP beside SAM; `deepseek_vl`: SigLIP alone); the caches, the HTTP door
and an int8 variant on the hybrid."""

from __future__ import annotations

import base64

import grpc
import openai
import pytest

from services.launcher import Mesh
from tests.helpers import (
    CASES,
    check_against_transformers,
    check_pictures_against_transformers,
    image_bytes,
    mesh_options,
    sample,
    scrape,
)
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc


@pytest.fixture(scope="module", params=["tiny_deepseek_hybrid", "tiny_deepseek"])
def served(request):
    """(mesh, checkpoint) for each DeepSeek-VL model type, with the HTTP door open."""
    model = request.getfixturevalue(request.param)
    with Mesh(mesh_options(model, http_port=0, feature_cache_mib=4, max_images=3)) as running:
        running.start(progress=lambda m: None)
        yield running, model


def ask(stub, data: bytes, prompt: str, n: int = 8):
    req = gateway_pb2.GenerateRequest(
        images=[pb.Image(data=data)], prompt=prompt, sampling=pb.SamplingParams(max_tokens=n, min_tokens=n)
    )
    return stub.GenerateUnary(req, timeout=120)


def test_greedy_tokens_match_transformers(served):
    mesh, model = served
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        check_against_transformers(gateway_pb2_grpc.GatewayStub(channel), model)


def test_several_pictures_in_one_request_match_transformers(served):
    mesh, model = served
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        check_pictures_against_transformers(gateway_pb2_grpc.GatewayStub(channel), model)


def test_a_repeated_picture_hits_both_caches_and_answers_as_the_miss(served):
    mesh, _ = served
    data = image_bytes(41, (333, 120), "JPEG")  # wide: padded to a square before both towers
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        first = ask(stub, data, "What is in the image?")
        second = ask(stub, data, "What is in the image?")
        third = ask(stub, data, "Describe the picture in detail.")  # other text, the same picture
    assert second.token_ids == first.token_ids
    assert second.usage.cached_tokens == second.usage.prompt_tokens + second.usage.image_tokens
    assert third.usage.cached_tokens >= third.usage.image_tokens  # the picture's pages, from the first
    llm = scrape(mesh.metrics_ports["llm"])
    assert (sample(llm, 'vlmesh_prefix_cache_tokens_total{result="hit"}') or 0) > 0


def test_the_openai_door_answers_as_the_grpc_door(served):
    mesh, _ = served
    data = image_bytes(42, (80, 200), "PNG")  # tall
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        want = ask(gateway_pb2_grpc.GatewayStub(channel), data, "What color is the shape?")
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    with openai.OpenAI(base_url=mesh.http_url(), api_key="none", max_retries=0, timeout=60) as client:
        got = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "What color is the shape?"},
                    ],
                }
            ],
            max_tokens=8,
            temperature=0,
            extra_body={"min_tokens": 8},
        )
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens + want.usage.image_tokens


def test_an_int8_variant_of_the_hybrid_serves(tiny_deepseek_hybrid):
    """`--quantize int8` quantizes the decoder, which every family shares: the hybrid answers with
    the tokens its full variant gives, or nearly (int8 rounding may change a late token)."""
    data, prompt = CASES[1]
    with Mesh(mesh_options(tiny_deepseek_hybrid, quantize="int8")) as running:
        running.start(progress=lambda m: None)
        with grpc.insecure_channel(running.target("gateway")) as channel:
            got = ask(gateway_pb2_grpc.GatewayStub(channel), data, prompt, 12)
    from tests.helpers import hf_greedy

    want = hf_greedy(tiny_deepseek_hybrid, data, prompt, 12)
    assert len(got.token_ids) == 12
    assert list(got.token_ids[:4]) == want[:4]
