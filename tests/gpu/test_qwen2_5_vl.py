"""Qwen2.5-VL on the GPU: the 7B-shaped preset cut to 2 decoder layers and 2 ViT layers (weights
saved by transformers) through the CUDA engine (graph-captured decode with its rotary offsets,
packed prefill with M-RoPE positions) and the vision encoder, against transformers, in fp32 and
in bf16."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    Parts,
    check_bf16_agreement,
    check_fp32_tokens_on_gpu,
    hf_inputs,
    hf_model_on_gpu,
    image_bytes,
    ours,
)

pytestmark = pytest.mark.gpu

# Pictures of several sizes: 224x224 (64 tokens), wide, tall, and one over max_pixels.
CASES = [
    (image_bytes(1, (224, 224), "JPEG"), "What is in the image?"),
    (image_bytes(2, (640, 200), "JPEG"), "Describe the picture in detail."),
    (image_bytes(3, (150, 500), "PNG"), "What shape is it?"),
    (image_bytes(4, (1600, 1200), "JPEG"), "Why?"),
]


@pytest.fixture(scope="module")
def cut_qwen(tmp_path_factory):
    from services.model.tiny import build_preset_checkpoint

    out = tmp_path_factory.mktemp("cut-qwen-7b")
    return build_preset_checkpoint(out, "qwen2.5-vl-7b-shaped", text_layers=2, vision_layers=2)


def test_the_cut_preset_gives_transformers_greedy_tokens_fp32(cut_qwen, exact_fp32):
    got = check_fp32_tokens_on_gpu(cut_qwen, CASES)
    assert len({tuple(ids) for ids in got}) == len(got)


def test_bf16_tokens_agree_with_transformers_as_its_own_bf16_does_with_fp32(cut_qwen):
    parts = Parts(cut_qwen, max_batch=4, device="cuda", dtype="bfloat16")
    try:
        got = ours(parts, CASES)
    finally:
        parts.engine.stop()
    check_bf16_agreement("Qwen2.5-VL cut preset", cut_qwen, CASES, got)


def test_the_tower_on_cuda_gives_transformers_image_features_fp32(cut_qwen, exact_fp32):
    from services.model.spec import load_spec
    from services.vision.encoder import VisionEncoder

    enc = VisionEncoder(load_spec(cut_qwen), "cuda", "float32")
    got = enc.encode([enc.pixels(data) for data, _ in CASES])
    model = hf_model_on_gpu(cut_qwen, torch.float32)
    inputs = hf_inputs(cut_qwen, [data for data, _ in CASES], "x")
    with torch.no_grad():
        want = model.model.get_image_features(
            pixel_values=inputs["pixel_values"].cuda(), image_grid_thw=inputs["image_grid_thw"].cuda()
        ).pooler_output
    for g, w, (_, h, wd) in zip(got, want, inputs["image_grid_thw"].tolist(), strict=True):
        assert g.shape == (h // 2, wd // 2, w.shape[-1])
        torch.testing.assert_close(g.flatten(0, 1), w, atol=1e-4, rtol=1e-4)


def test_the_tower_in_a_graph_per_batch_of_grids_equals_it_eager_fp32(cut_qwen, exact_fp32):
    """Each batch's grids captured at their second sight (services/vision/graphs.py GridGraphs),
    replayed after: the same features as the eager tower, for a batch with one grid twice and
    its pictures out of the key's order."""
    from services.model.spec import load_spec
    from services.vision.encoder import VisionEncoder

    spec = load_spec(cut_qwen)
    eager = VisionEncoder(spec, "cuda", "float32")
    graphed = VisionEncoder(spec, "cuda", "float32", graphs_up_to=4)
    assert graphed.grid_graphs is not None
    batches = [[data for data, _ in CASES[:3]] + [CASES[0][0]], [CASES[3][0], CASES[1][0]]]
    for batch in batches * 3:
        pixels = [eager.pixels(data) for data in batch]
        want, got = eager.encode(pixels), graphed.encode(pixels)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    captured = set(graphed.grid_graphs._graphs)
    assert len(captured) == len(batches), captured  # one graph per batch's grids, every one captured


def test_graphs_dropped_for_new_grids_leave_every_replay_right_fp32(cut_qwen, exact_fp32, monkeypatch):
    """One graph at a time and every graph stale after a batch: each batch's grids take the place
    of the last's (the dropped graph's memory reused by the next capture in the shared pool), and
    every replay still gives the eager tower's features."""
    from services.model.spec import load_spec
    from services.vision import graphs
    from services.vision.encoder import VisionEncoder

    monkeypatch.setattr(graphs, "STALE_BATCHES", 1)
    spec = load_spec(cut_qwen)
    eager = VisionEncoder(spec, "cuda", "float32")
    graphed = VisionEncoder(spec, "cuda", "float32", graphs_up_to=4)
    graphed.grid_graphs.max_graphs = 1
    captures = []
    capture = graphed.grid_graphs._capture
    monkeypatch.setattr(graphed.grid_graphs, "_capture", lambda *a: captures.append(a[0]) or capture(*a))
    one, two = [CASES[0][0], CASES[1][0]], [CASES[2][0]]
    for batch in [one, one, one, two, two, two, one, one, one]:
        pixels = [eager.pixels(data) for data in batch]
        for g, w in zip(graphed.encode(pixels), eager.encode(pixels), strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert len(captures) == 3 and captures[0] == captures[2] != captures[1], captures
    assert list(graphed.grid_graphs._graphs) == [captures[2]]
