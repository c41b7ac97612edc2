"""The feature cache and the prefix cache through a real mesh on the demo model, under eviction.

The demo model's answers name the picture's shape and colour, so features or KV pages shared
between two pictures would show as wrong answers.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.launcher import Mesh
from services.model.shapes import PROMPTS, encode, render
from tests.helpers import mesh_options, sample, scrape
from vlmesh.v1 import common_pb2 as pb
from vlmesh.v1 import gateway_pb2, gateway_pb2_grpc

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"
KEPT = 3  # feature slots the cache may keep: fewer than the pictures, so it evicts


@pytest.fixture(scope="module")
def mesh():
    import torch

    from services.llm.kv_cache import page_bytes
    from services.model.spec import load_spec

    spec = load_spec(DEMO)
    slot = spec.image_tokens * spec.text.hidden * 4  # float32 features, page-aligned already
    opts = mesh_options(
        DEMO,
        max_llm_batch=8,
        max_vision_batch=4,
        warmup_requests=0,  # every lookup counted below is the test's
        feature_cache_mib=(KEPT + 0.5) * slot / 2**20,
        # A small pool, 48 pages of 16 positions (a request takes about 11): the prefix cache evicts.
        kv_cache_gib=48.5 * page_bytes(spec, torch.float32, 16) / 2**30,
    )
    with Mesh(opts) as running:
        running.start(progress=lambda m: None)
        yield running


def ask(stub, data: bytes, prompt: str):
    req = gateway_pb2.GenerateRequest(
        images=[pb.Image(data=data)], prompt=prompt, sampling=pb.SamplingParams(max_tokens=8)
    )
    return stub.GenerateUnary(req, timeout=120)


def counter(text: str, series: str) -> float:
    return sample(text, series) or 0.0


def test_64_concurrent_requests_over_8_pictures_each_get_their_own_answer(mesh):
    pics = [render(np.random.default_rng([777, i])) for i in range(8)]
    data = [encode(p.image, "PNG", 0) for p in pics]
    prompts = list(PROMPTS)
    jobs = [(i % 8, prompts[(i // 8) % len(prompts)]) for i in range(64)]
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda job: ask(stub, data[job[0]], job[1]), jobs))
        ask(stub, data[0], jobs[0][1])
        again = ask(stub, data[0], jobs[0][1])  # right after the same request: its prompt pages are cached
    wrong = [
        (i, prompt, r.text, pics[i].answer(prompt))
        for (i, prompt), r in zip(jobs, results, strict=True)
        if r.text != pics[i].answer(prompt)
    ]
    assert not wrong, wrong[:5]
    assert again.text == pics[0].answer(jobs[0][1]) and again.usage.cached_tokens > 144
    # Greedy, and its whole prompt cached with the prompt's first token: it computed no prompt position.
    assert again.usage.cached_tokens == again.usage.prompt_tokens + again.usage.image_tokens
    # The llm held the picture's positions: the gateway sent its content key alone, and no vision stage ran.
    assert again.timings.preprocess_ms == again.timings.vision_ms == 0
    vision, llm = scrape(mesh.metrics_ports["vision"]), scrape(mesh.metrics_ports["llm"])
    gateway = scrape(mesh.metrics_ports["gateway"])
    hits = counter(vision, 'vlmesh_feature_cache_lookups_total{result="hit"}')
    misses = counter(vision, 'vlmesh_feature_cache_lookups_total{result="miss"}')
    skipped = counter(gateway, 'vlmesh_vision_skips_total{result="skipped"}')
    assert hits + misses + skipped == 66 and skipped >= 1
    assert hits > 0 and misses > 8  # 8 pictures, 3 slots: evicted and encoded again
    assert counter(vision, 'vlmesh_arena_pages{arena="shm",state="kept"}') <= KEPT
    assert counter(llm, 'vlmesh_prefix_cache_tokens_total{result="hit"}') > 0
    assert counter(llm, "vlmesh_prefix_first_tokens_total") >= 1


def test_another_question_about_a_picture_the_llm_holds_skips_the_vision(mesh):
    """The llm keeps a part of a page that ends where the picture does (services/llm/prefix.py): a
    new question finds every image position cached, so the gateway sends the content key alone."""
    pic = render(np.random.default_rng([999, 0]))
    data = encode(pic.image, "PNG", 0)
    prompts = list(PROMPTS)[:2]
    with grpc.insecure_channel(mesh.target("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        first, second = (ask(stub, data, p) for p in prompts)
    assert [first.text, second.text] == [pic.answer(p) for p in prompts]
    assert first.timings.vision_ms > 0 and first.usage.cached_tokens == 0
    assert second.timings.preprocess_ms == second.timings.vision_ms == 0
    assert second.usage.cached_tokens > 144  # the demo model's 144 image positions, and the text before them
