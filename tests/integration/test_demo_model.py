"""The shipped demo model sees: accuracy through the full mesh, and no mixed-up features."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.launcher import Mesh
from services.model.shapes import PROMPTS, encode, render
from tests.helpers import hf_greedy, mesh_options
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
TEST_SEED = 424242  # training used seed 0, the card's evaluation 1000003
FORMATS = [("PNG", 0), ("JPEG", 90), ("WEBP", 90), ("BMP", 0), ("JPEG", 75)]


@pytest.fixture(scope="module")
def demo_mesh():
    assert (DEMO / "config.json").is_file(), "the demo model must ship in models/demo"
    with Mesh(mesh_options(DEMO, max_llm_batch=16, max_vision_batch=8)) as mesh:
        mesh.start(progress=lambda m: None)
        yield mesh


@pytest.fixture(scope="module")
def stub(demo_mesh):
    with grpc.insecure_channel(demo_mesh.target("gateway")) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def ask(stub, data: bytes, prompt: str) -> str:
    req = gateway_pb2.GenerateRequest(
        images=[pb.Image(data=data)], prompt=prompt, sampling=pb.SamplingParams(max_tokens=8)
    )
    return stub.GenerateUnary(req, timeout=120).text


def pictures(n: int):
    out = []
    for i in range(n):
        pic = render(np.random.default_rng([TEST_SEED, i]))
        fmt, quality = FORMATS[i % len(FORMATS)]
        out.append((pic, encode(pic.image, fmt, quality)))
    return out


def test_accuracy_on_300_fresh_pictures(stub):
    pics = pictures(300)
    jobs = [(pic, data, prompt) for pic, data in pics for prompt in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: ask(stub, job[1], job[2]), jobs))
    right: Counter[str] = Counter()
    wrong: list[str] = []
    for (pic, _, prompt), answer in zip(jobs, answers, strict=True):
        if answer == pic.answer(prompt):
            right[prompt] += 1
        else:
            wrong.append(f"{prompt!r}: {answer!r} != {pic.answer(prompt)!r}")
    accuracy = {prompt: right[prompt] / len(pics) for prompt in PROMPTS}
    print("accuracy through the mesh:", accuracy)
    assert all(a >= 0.97 for a in accuracy.values()), (accuracy, wrong[:10])


def test_concurrent_answers_equal_sequential(stub):
    """32 requests in flight at once, mixed prompts: batching must not mix up features."""
    jobs = [(data, list(PROMPTS)[i % 3]) for i, (_, data) in enumerate(pictures(32))]
    sequential = [ask(stub, data, prompt) for data, prompt in jobs]
    with ThreadPoolExecutor(32) as pool:
        concurrent = list(pool.map(lambda job: ask(stub, *job), jobs))
    assert concurrent == sequential
    assert len(set(sequential)) > 5  # the answers really depend on the pictures


def test_same_picture_twice_same_answer(stub):
    pic, data = pictures(1)[0]
    first = ask(stub, data, "What is in the image?")
    assert first == ask(stub, data, "What is in the image?") == pic.answer("What is in the image?")


def test_transformers_loads_the_demo_model_and_agrees(stub):
    """The shipped checkpoint is a plain transformers LLaVA: its greedy tokens equal the mesh's."""
    for pic, data in pictures(4):
        req = gateway_pb2.GenerateRequest(
            images=[pb.Image(data=data)],
            prompt="What is in the image?",
            sampling=pb.SamplingParams(max_tokens=5, min_tokens=5),
        )
        ours = list(stub.GenerateUnary(req, timeout=60).token_ids)
        assert ours == hf_greedy(DEMO, data, "What is in the image?", 5), pic
