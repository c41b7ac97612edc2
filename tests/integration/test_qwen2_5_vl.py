"""Qwen2.5-VL through the whole mesh: pictures read at their own size (a varying number of tokens
each, handed from vision to llm as their grid [rows, cols, H]) and multimodal rotary positions.
Greedy tokens equal transformers' own `generate` (fp32, CPU) for 1, 2 and 3 pictures of
different sizes and aspect ratios in one request; a repeated picture hits the caches and answers
as the miss; the OpenAI door answers as gRPC."""

from __future__ import annotations

import base64

import grpc
import openai
import pytest

from services.launcher import Mesh
from tests.helpers import hf_greedy, hf_inputs, image_bytes, mesh_options, sample, scrape
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

# (width, height): under min_pixels (grown), wide, tall, square, over max_pixels (shrunk).
PICTURES = [image_bytes(5, (40, 60)), image_bytes(6, (90, 300), "JPEG"), image_bytes(7, (200, 70), "PNG"),
            image_bytes(8, (128, 128)), image_bytes(9, (400, 500), "JPEG")]  # fmt: skip


@pytest.fixture(scope="module")
def mesh(tiny_qwen):
    with Mesh(mesh_options(tiny_qwen, http_port=0, feature_cache_mib=4, max_images=3)) as running:
        running.start(progress=lambda m: None)
        yield running


def ask(stub, pictures: list[bytes], prompt: str, n: int = 12):
    req = gateway_pb2.GenerateRequest(
        images=[pb.Image(data=d) for d in pictures],
        prompt=prompt,
        sampling=pb.SamplingParams(max_tokens=n, min_tokens=n),
    )
    return stub.GenerateUnary(req, timeout=120)


def test_one_two_and_three_pictures_match_transformers(mesh, tiny_qwen):
    got = {}
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for order in ((0,), (1,), (2,), (4,), (0, 1), (1, 0), (3, 2, 1)):
            pictures = [PICTURES[i] for i in order]
            result = ask(stub, pictures, "Compare the pictures.")
            want = hf_greedy(tiny_qwen, pictures, "Compare the pictures.", 12)
            assert list(result.token_ids) == want, f"pictures {order}: mesh {list(result.token_ids)} != {want}"
            tokens = int(hf_inputs(tiny_qwen, pictures, "x")["image_grid_thw"].prod(-1).sum()) // 4
            assert result.usage.image_tokens == tokens, order
            got[order] = (want, tokens)
    # Each picture takes tokens by its size (28 px a token, the area within [56^2, 28^2 * 64] px).
    assert len({got[(i,)][1] for i in (0, 1, 2, 4)}) == 4
    assert got[(0, 1)][1] == got[(0,)][1] + got[(1,)][1] and got[(4,)][1] <= 64
    assert len({tuple(w) for w, _ in got.values()}) >= 5  # the pictures matter
    assert got[(0, 1)][0] != got[(1, 0)][0]  # each picture's features sit where its placeholder is


def test_a_repeated_picture_hits_both_caches_and_answers_as_the_miss(mesh):
    data = image_bytes(41, (150, 333), "JPEG")
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        first = ask(stub, [data], "What is in the image?")
        second = ask(stub, [data], "What is in the image?")
        both = ask(stub, [data, data], "Are they the same?")  # repeated inside one request too
    assert second.token_ids == first.token_ids
    assert second.usage.cached_tokens == second.usage.prompt_tokens + second.usage.image_tokens
    assert both.usage.image_tokens == 2 * first.usage.image_tokens
    vision = scrape(mesh.metrics_ports["vision"])
    assert (sample(vision, 'vlmesh_feature_cache_lookups_total{result="hit"}') or 0) >= 2


def test_the_openai_door_answers_as_the_grpc_door(mesh):
    data = image_bytes(42, (80, 200), "PNG")
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        want = ask(gateway_pb2_grpc.GatewayStub(channel), [data, PICTURES[0]], "What color is the shape?")
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()}}
        for d in (data, PICTURES[0])
    ]
    with openai.OpenAI(base_url=mesh.http_url(), api_key="none", max_retries=0, timeout=60) as client:
        got = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What color is the shape?"}]}],
            max_tokens=12,
            temperature=0,
            extra_body={"min_tokens": 12},
        )
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == want.usage.prompt_tokens + want.usage.image_tokens


def test_a_conversation_with_pictures_in_two_turns_matches_transformers(mesh, tiny_qwen):
    first, second = PICTURES[1], PICTURES[2]
    turns = [
        ("user", [pb.ContentPart(image=True), pb.ContentPart(text="What is in this picture?")]),
        ("assistant", [pb.ContentPart(text="Some noise.")]),
        ("user", [pb.ContentPart(text="And here?"), pb.ContentPart(image=True)]),
    ]
    req = gateway_pb2.GenerateRequest(
        images=[pb.Image(data=first), pb.Image(data=second)],
        messages=[pb.ChatMessage(role=role, content=content) for role, content in turns],
        sampling=pb.SamplingParams(max_tokens=12, min_tokens=12),
    )
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        result = gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(req, timeout=120)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Some noise."}]},
        {"role": "user", "content": [{"type": "text", "text": "And here?"}, {"type": "image"}]},
    ]
    assert list(result.token_ids) == hf_greedy(tiny_qwen, [first, second], messages, 12)


def test_a_sliver_of_a_picture_is_refused_naming_it_and_the_mesh_serves_on(mesh):
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            ask(stub, [PICTURES[0], image_bytes(3, (2000, 5))], "What is it?")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "images[1] is 2000x5: an aspect ratio over 200 is refused" in err.value.details()
        assert len(ask(stub, [PICTURES[0]], "What is it?").token_ids) == 12


def test_a_request_reads_a_picture_smaller_with_max_pixels(mesh, tiny_qwen):
    """Image.max_pixels lowers the processor's limit for that picture: fewer tokens, transformers'
    tokens with the same limit, a cache entry of its own; the HTTP door's image_url.max_pixels too."""
    data, limit = PICTURES[4], 28 * 28 * 16  # 400x500 px: 64 tokens at the model's limit, 16 at this one
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        full = ask(stub, [data], "What is in the image?")
        req = gateway_pb2.GenerateRequest(
            images=[pb.Image(data=data, max_pixels=limit)],
            prompt="What is in the image?",
            sampling=pb.SamplingParams(max_tokens=12, min_tokens=12),
        )
        small = stub.GenerateUnary(req, timeout=120)
        for bad in (100, 28 * 28 * 65):  # under min_pixels, over the model's max_pixels
            req.images[0].max_pixels = bad
            with pytest.raises(grpc.RpcError) as err:
                stub.GenerateUnary(req, timeout=120)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"images[0].max_pixels={bad} is out of range: use 3136 to 50176" in err.value.details()
    assert small.usage.image_tokens <= 16 < full.usage.image_tokens
    assert list(small.token_ids) == hf_greedy(tiny_qwen, [data], "What is in the image?", 12, max_pixels=limit)
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    with openai.OpenAI(base_url=mesh.http_url(), api_key="none", max_retries=0, timeout=60) as client:
        got = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url, "max_pixels": limit}},
                        {"type": "text", "text": "What is in the image?"},
                    ],
                }
            ],
            max_tokens=12,
            temperature=0,
            extra_body={"min_tokens": 12},
        )
    assert got.choices[0].message.content == small.text
